"""The storage a run pins: its URL (recorded when the run is created; every reader resolves the
run's keys against it), the marker that tells a worker it reaches that storage, and the rule
that refuses a local storage folder for a fleet.

The rule: a ledger or broker that another machine could reach (a Postgres or Redis URL whose
host is not loopback) is a fleet; a fleet's processes run in other folders and on other
machines, so a storage URL that is a local path (`./.tokenmill/storage`, the default, or any
`file://` folder) is refused at enqueue with the setting to make, unless
`TOKENMILL_SINGLE_MACHINE=true` says every process sees that folder (one machine, or a mount
at the same path on every node).

The marker `runs/<run>/storage.json` is written beside the images when an enqueue first opens
the run's storage for them; a worker that cannot read it (another machine's folder, a bucket
it has no access to) does not reach the run's images, so it gives their items back instead of
failing them.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

from app.core.errors import ConfigurationError, NotFound, TokenmillError
from app.core.network import is_loopback
from app.core.settings import Settings
from app.storage.shards import Location, StorageError, read_object, write_object

LOCAL_PROTOCOLS = ("file", "local")


class StorageUnreachable(TokenmillError):
    """This process does not reach a run's storage (its items go back, nothing fails)."""


def pinned_url(settings: Settings) -> str:
    """The storage URL a new run records: TOKENMILL_STORAGE_URL (a path made an absolute
    file:// URL, so a reader in another folder finds the same one), else the data dir's."""
    url = settings.resolved_storage_url()
    if "://" not in url:
        url = Path(url).expanduser().absolute().as_uri()
    return url.rstrip("/")


def is_local(url: str) -> bool:
    """A storage URL that names a folder of this machine (a path or a file:// URL)."""
    return "://" not in url or url.split("://", 1)[0].lower() in LOCAL_PROTOCOLS


def reachable_elsewhere(url: str) -> bool:
    """A ledger or broker URL another machine could reach: a host that is not loopback (no host:
    a SQLite file, a Unix socket, the folder broker)."""
    host = urlsplit(url).hostname
    return bool(host) and not is_loopback(host or "")


def fleet_refusal(settings: Settings, storage_url: str) -> str | None:
    """Why an enqueue into storage_url is refused (a shared ledger or broker with a local
    storage folder, and no TOKENMILL_STORAGE_SHARED), naming the setting to make; None if not."""
    if settings.storage_shared or settings.single_machine or not is_local(storage_url):
        return None
    shared = [
        name
        for name, url in (
            ("TOKENMILL_DATABASE_URL", settings.resolved_database_url()),
            ("TOKENMILL_BROKER_URL", settings.resolved_broker_url()),
        )
        if reachable_elsewhere(url)
    ]
    if not shared:
        return None
    return (
        f"{' and '.join(shared)} can be reached from other machines, but the storage is the "
        f"local folder {storage_url}, which workers and exports on other machines or in other "
        "folders may not see: set TOKENMILL_STORAGE_URL=s3://BUCKET/PREFIX, or "
        "TOKENMILL_STORAGE_SHARED=true if every process sees this folder at this path (they "
        "all run on this machine, or every node mounts it there, as an NFS folder)"
    )


def check_fleet_storage(settings: Settings, storage_url: str) -> None:
    """ConfigurationError when fleet_refusal refuses storage_url."""
    refusal = fleet_refusal(settings, storage_url)
    if refusal is not None:
        raise ConfigurationError(refusal)


def marker_name(run_name: str) -> str:
    """Where the run's marker lives in its store."""
    return f"runs/{run_name}/storage.json"


def _marker(run_id: int, run_name: str) -> bytes:
    return json.dumps({"run": run_name, "run_id": run_id}, sort_keys=True).encode()


def write_marker(loc: Location, run_id: int, run_name: str) -> None:
    """Record in loc that it is run's storage (unless already recorded)."""
    if reaches(loc, run_id, run_name):
        return
    folder, _, name = marker_name(run_name).rpartition("/")
    sub = Location(fs=loc.fs, root=loc.path(folder), url=loc.uri(folder))
    try:
        write_object(sub, name, _marker(run_id, run_name))
    except OSError as exc:
        raise StorageError(f"could not write {marker_name(run_name)} to {loc.url}: {exc}") from exc


def reaches(loc: Location, run_id: int, run_name: str) -> bool:
    """Whether loc holds run's marker: this process reaches the storage the run's enqueue
    wrote to. False when it is missing or names another run (a folder of the same path on
    another machine); StorageError when the storage did not answer."""
    try:
        data = read_object(loc, marker_name(run_name))
    except (NotFound, FileNotFoundError, PermissionError):
        return False
    except OSError as exc:
        raise StorageError(f"could not read {marker_name(run_name)} in {loc.url}: {exc}") from exc
    try:
        return bool(json.loads(data) == json.loads(_marker(run_id, run_name)))
    except ValueError:
        return False
