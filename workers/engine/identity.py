"""A worker's identity in the fleet: its node, its server's name, its Celery node name, the URL
the control plane registers for its server, and the checks that refuse a clash at start.

The rule, so that one worker command is right on every GPU node: the node is
TOKENMILL_NODE_NAME, else the machine's host name; the server is TOKENMILL_SERVER_NAME, else
host:port of TOKENMILL_SGLANG_URL with a loopback host replaced by the node; the Celery node
name is `-n`, else `<server>@<node>`.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from sqlalchemy import Engine

from app.core.errors import ConfigurationError
from app.core.network import is_loopback
from app.core.settings import Settings
from app.ledger import registry
from app.storage import run_store
from workers.control.pausing import AliveWorkers

log = logging.getLogger(__name__)

# how long a worker waits at start for a running worker of the same name to answer a ping
PING_TIMEOUT_S = 1.0
# how long it tries to connect to its server's URLs when it registers a derived one
CONNECT_TIMEOUT_S = 1.0


class IdentityRefused(ConfigurationError):
    """This worker's names clash with a running worker's, or its server cannot be registered
    at a URL the fleet reaches; the message says what to set."""


def server_name_for(url: str, node: str | None = None) -> str:
    """A server's default name: host:port of its URL; with node, a loopback host stands for
    that node (so `http://localhost:30000` on gpu-a is `gpu-a:30000`)."""
    parts = urlsplit(url)
    if node and parts.hostname and is_loopback(parts.hostname):
        return f"{node}:{parts.port}" if parts.port else node
    return parts.netloc or url


def worker_name_for(server_name: str, node: str) -> str:
    """The default Celery node name, `<server>@<node>` (Celery splits a name at its first @)."""
    return f"{server_name.replace('@', '-')}@{node}"


@dataclass(frozen=True)
class WorkerIdentity:
    node: str
    server_name: str
    worker_name: str
    # the URL this worker sends to (TOKENMILL_SGLANG_URL)
    local_url: str

    @classmethod
    def of(cls, settings: Settings, worker_name: str | None = None) -> WorkerIdentity:
        """The identity the rule gives; worker_name is `-n` when the user gave one."""
        node = settings.resolved_node_name()
        server = settings.server_name or server_name_for(settings.sglang_url, node)
        return cls(
            node=node,
            server_name=server,
            worker_name=worker_name or worker_name_for(server, node),
            local_url=settings.sglang_url,
        )


def one_machine(settings: Settings) -> bool:
    """Ledger and broker are on this machine (loopback or embedded), so every process of the
    fleet is too: a loopback server URL is one the whole fleet reaches."""
    urls = (settings.resolved_database_url(), settings.resolved_broker_url())
    # the rule that also refuses a local storage folder for a fleet (app.storage.run_store)
    return not any(run_store.reachable_elsewhere(url) for url in urls)


def host_addresses(host: str) -> list[str]:
    """The addresses a host name resolves to (none when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return sorted({str(i[4][0]) for i in infos})


def port_open(url: str) -> bool:
    """Something accepts TCP connections at url's host and port."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname or "", port), timeout=CONNECT_TIMEOUT_S):
            return True
    except OSError:
        return False


def fleet_url(
    identity: WorkerIdentity,
    *,
    one_machine: bool,
    addresses: Callable[[str], list[str]] = host_addresses,
    connects: Callable[[str], bool] = port_open,
) -> str:
    """The URL to register for this worker's server when it is not registered yet: one the
    rest of the fleet (the watchdog, `tokenmill restart`, parity) reaches. A loopback URL of a
    fleet that spans machines becomes `scheme://<node>:<port>`, if the node name resolves to an
    address that is not loopback and the server does not answer only on loopback."""
    local = identity.local_url
    parts = urlsplit(local)
    if one_machine or not is_loopback(parts.hostname or ""):
        return local
    port = f":{parts.port}" if parts.port else ""
    node_url = urlunsplit(parts._replace(netloc=f"{identity.node}{port}"))
    add = f"`tokenmill servers add {identity.server_name} {parts.scheme}://HOST{port}`"
    found = addresses(identity.node)
    if not found or all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found):
        why = "does not resolve" if not found else f"resolves to {', '.join(found)} (loopback)"
        raise IdentityRefused(
            f"server {identity.server_name} is not registered, and its URL {local} is loopback: "
            "the rest of the fleet (the watchdog, tokenmill restart, parity) cannot reach it "
            f"there, and the node name {identity.node} {why}. Register the URL the fleet "
            f"reaches it at, once, from any machine: {add} (HOST: this node's address)"
        )
    if connects(local) and not connects(node_url):
        raise IdentityRefused(
            f"server {identity.server_name} is not registered, and it answers on {local} but "
            f"not on {node_url}, where the rest of the fleet would reach it: start SGLang with "
            f"--host 0.0.0.0, or register the URL the fleet reaches it at: {add}"
        )
    return node_url


def check_names(
    identity: WorkerIdentity, server: registry.ServerInfo | None, alive: AliveWorkers
) -> None:
    """Refuse a worker whose Celery node name a running worker has, or whose server is served
    by running workers on another node. Workers that do not answer a ping are gone."""
    other_node = server is not None and server.node not in (None, identity.node)
    theirs = list(server.workers) if server is not None and other_node else []
    try:
        up = alive(_unique([identity.worker_name, *theirs]))
    except Exception as exc:  # a broker without remote control: nothing to ask
        log.warning(
            "could not ask which workers are running (%s); names not checked",
            exc,
            extra={"action": "names_unchecked"},
        )
        return
    if identity.worker_name in up:
        raise IdentityRefused(
            f"a worker named {identity.worker_name} is already running: give this one its own "
            f"name, e.g. `celery -A app worker -E -n {identity.server_name}-2@{identity.node}` "
            "(a worker for another server or on another node: set its TOKENMILL_SERVER_NAME "
            "or TOKENMILL_NODE_NAME instead)"
        )
    serving = sorted(up & set(theirs))
    if server is not None and serving:
        raise IdentityRefused(
            f"server {identity.server_name} is served from node {server.node} (workers "
            f"{', '.join(serving)}), and this worker runs on node {identity.node}: each node's "
            "server needs its own name. Set TOKENMILL_SERVER_NAME for this node's server "
            "(unset, a loopback TOKENMILL_SGLANG_URL is named <node>:<port>), or, if this "
            f"worker does serve the server on {server.node}, TOKENMILL_NODE_NAME={server.node}"
        )


def _unique(names: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(names))


def claim(
    settings: Settings, db: Engine, identity: WorkerIdentity, alive: AliveWorkers
) -> registry.ServerInfo:
    """Check this worker's names, then record its server: registered at the fleet URL when
    new; a registered one keeps its URL and gets this worker's URL and node beside it."""
    with db.connect() as conn:
        server = registry.find_server(conn, identity.server_name)
    check_names(identity, server, alive)
    url = server.url if server else fleet_url(identity, one_machine=one_machine(settings))
    with db.begin() as conn:
        return registry.claim_server(
            conn, identity.server_name, url=url, worker_url=identity.local_url, node=identity.node
        )
