"""The storage a run pins: the URL recorded, the rule that refuses a local folder for a fleet,
and the marker a worker reads to know it reaches the run's storage."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.core.errors import ConfigurationError
from app.core.settings import Settings
from app.storage import run_store
from app.storage.shards import open_location


def settings(tmp_path: Path, **values: object) -> Settings:
    return Settings(data_dir=tmp_path, **values)  # type: ignore[arg-type]


def test_a_run_pins_an_absolute_url_of_its_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert run_store.pinned_url(settings(tmp_path)) == (tmp_path / "storage").as_uri()
    assert run_store.pinned_url(settings(tmp_path, storage_url="store")) == (
        (tmp_path / "store").as_uri()
    )
    assert run_store.pinned_url(settings(tmp_path, storage_url="s3://b/p/")) == "s3://b/p"


@pytest.mark.parametrize(
    ("database", "broker", "storage", "refused"),
    [
        (None, None, None, None),  # embedded: one machine
        ("postgresql://u@127.0.0.1/db", "redis://localhost:6379/0", None, None),  # loopback
        ("postgresql://u@db-host.example/db", None, None, "TOKENMILL_DATABASE_URL"),
        ("postgresql://u@127.0.0.1/db", "redis://192.0.2.10:6379/0", None, "TOKENMILL_BROKER_URL"),
        ("postgresql://u@192.0.2.9/db", "redis://192.0.2.10/0", "s3://bucket/store", None),
        ("postgresql://u@192.0.2.9/db", None, "/mnt/shared/store", "TOKENMILL_DATABASE_URL"),
    ],
)
def test_a_shared_ledger_or_broker_with_a_local_store_is_refused(
    tmp_path: Path,
    database: str | None,
    broker: str | None,
    storage: str | None,
    refused: str | None,
) -> None:
    s = settings(tmp_path, database_url=database, broker_url=broker, storage_url=storage)
    refusal = run_store.fleet_refusal(s, run_store.pinned_url(s))
    if refused is None:
        assert refusal is None
        return
    assert refusal is not None and refused in refusal
    assert "TOKENMILL_STORAGE_URL=s3://" in refusal and "TOKENMILL_STORAGE_SHARED=true" in refusal
    assert "NFS" in refusal
    with pytest.raises(ConfigurationError):
        run_store.check_fleet_storage(s, run_store.pinned_url(s))
    # the user states that every process sees the folder at one path (a shared NFS folder, or
    # one machine: TOKENMILL_SINGLE_MACHINE, the older name, says the same)
    for shared in ({"storage_shared": True}, {"single_machine": True}):
        seen = settings(
            tmp_path, database_url=database, broker_url=broker, storage_url=storage, **shared
        )
        assert run_store.fleet_refusal(seen, run_store.pinned_url(seen)) is None


def test_the_marker_tells_the_runs_storage_from_a_folder_of_the_same_path(tmp_path: Path) -> None:
    loc = open_location((tmp_path / "storage").as_uri())
    assert not run_store.reaches(loc, 7, "r1")  # another machine's folder: nothing there
    run_store.write_marker(loc, 7, "r1")
    assert run_store.reaches(loc, 7, "r1")
    assert not run_store.reaches(loc, 8, "r1")  # a run of the same name, deleted and made again
    run_store.write_marker(loc, 8, "r1")
    assert run_store.reaches(loc, 8, "r1")


def test_an_export_never_points_at_an_image_its_store_does_not_hold(tmp_path: Path) -> None:
    import io
    from types import SimpleNamespace
    from typing import cast

    from PIL import Image

    from app.core.images import ImageRef
    from app.ledger import reads
    from app.outputs.image_rows import ImageExportError, ImageRows
    from app.storage.image_store import put_image

    loc = open_location((tmp_path / "storage").as_uri())
    data = io.BytesIO()
    Image.new("RGB", (4, 4), (1, 2, 3)).save(data, "PNG")
    here = put_image(loc, data.getvalue(), "a.png")
    gone = ImageRef("0" * 64, "images/" + "0" * 64 + ".png", 1, 1, "PNG", 1, "gone.png")
    rows = ImageRows(None, loc, check_present=True)
    item = cast(reads.StoredItem, SimpleNamespace(id=1, item_key="k", sample_index=0, turn_index=0))
    assert rows.uri(item, 0, here) == loc.uri(here.key)
    with pytest.raises(ImageExportError, match="missing from"):
        rows.uri(item, 1, gone)
