"""The naming rule of a worker (node, server, Celery node name), the URL it registers for a
new server, and the refusals of a clash at start."""

from __future__ import annotations

import socket
from datetime import UTC, datetime

import pytest

from app.core.settings import Settings
from app.ledger import registry
from workers.engine.identity import (
    IdentityRefused,
    WorkerIdentity,
    check_names,
    fleet_url,
    one_machine,
    server_name_for,
)


def settings(**values: object) -> Settings:
    return Settings.model_validate(values)


def identity(
    url: str = "http://localhost:30000", node: str = "gpu-a", **values: str
) -> WorkerIdentity:
    return WorkerIdentity.of(settings(sglang_url=url, node_name=node, **values))


def server(name: str, node: str | None, workers: list[str]) -> registry.ServerInfo:
    return registry.ServerInfo(
        name=name,
        url=f"http://{name}",
        state="healthy",
        state_since=datetime.now(UTC),
        paused=False,
        paused_by=None,
        pause_reason=None,
        consecutive_failures=0,
        consecutive_successes=0,
        last_probe_at=None,
        last_probe_ok=None,
        last_probe_latency_s=None,
        last_error=None,
        fingerprint=None,
        restart_command=None,
        workers=workers,
        node=node,
    )


@pytest.mark.parametrize(
    ("url", "node", "name"),
    [
        ("http://localhost:30000", "gpu-a", "gpu-a:30000"),
        ("http://127.0.0.1:30001", "gpu-a", "gpu-a:30001"),
        ("http://[::1]:30000", "gpu-b", "gpu-b:30000"),
        ("http://localhost", "gpu-a", "gpu-a"),
        ("http://gpu-b.invalid:30000", "gpu-a", "gpu-b.invalid:30000"),  # not loopback: kept
        ("http://localhost:30000", None, "localhost:30000"),  # no node (`tokenmill run`)
    ],
)
def test_a_loopback_host_stands_for_the_node(url: str, node: str | None, name: str) -> None:
    assert server_name_for(url, node) == name


def test_every_node_gets_its_own_names_from_one_command() -> None:
    a, b = identity(node="gpu-a"), identity(node="gpu-b")
    assert (a.server_name, a.worker_name) == ("gpu-a:30000", "gpu-a:30000@gpu-a")
    assert (b.server_name, b.worker_name) == ("gpu-b:30000", "gpu-b:30000@gpu-b")
    assert a.local_url == "http://localhost:30000"


def test_names_the_user_sets_win() -> None:
    named = identity(server_name="big@one")
    assert (named.server_name, named.worker_name) == ("big@one", "big-one@gpu-a")
    given = WorkerIdentity.of(settings(node_name="gpu-a"), "w1@gpu-a")
    assert given.worker_name == "w1@gpu-a"


def test_the_node_defaults_to_the_host_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENMILL_NODE_NAME", raising=False)
    assert Settings().resolved_node_name() == socket.gethostname()
    monkeypatch.setenv("TOKENMILL_NODE_NAME", "gpu-c")
    assert Settings().resolved_node_name() == "gpu-c"


@pytest.mark.parametrize(
    ("database_url", "broker_url", "expected"),
    [
        (None, None, True),  # embedded: SQLite and the folder broker
        ("postgresql://postgres@127.0.0.1/x", "redis://localhost:6379/0", True),
        ("postgresql:///x", "redis://127.0.0.1:6379/0", True),  # a Unix socket
        ("postgresql://tm@db-host.invalid/x", "redis://127.0.0.1:6379/0", False),
        ("postgresql://postgres@127.0.0.1/x", "redis://redis-host.invalid:6379/0", False),
    ],
)
def test_one_machine_means_ledger_and_broker_on_loopback(
    database_url: str | None, broker_url: str | None, expected: bool
) -> None:
    assert one_machine(settings(database_url=database_url, broker_url=broker_url)) is expected


def lan(host: str) -> list[str]:
    return ["10.0.0.7"]


def test_a_url_that_is_not_loopback_is_registered_as_it_is() -> None:
    mine = identity("http://10.0.0.7:30000")
    assert fleet_url(mine, one_machine=False, addresses=lan) == "http://10.0.0.7:30000"


def test_on_one_machine_the_loopback_url_is_the_fleet_url() -> None:
    assert fleet_url(identity(), one_machine=True) == "http://localhost:30000"


def test_a_loopback_url_becomes_the_nodes_url_when_the_fleet_reaches_the_node() -> None:
    reached = fleet_url(identity(), one_machine=False, addresses=lan, connects=lambda u: True)
    assert reached == "http://gpu-a:30000"
    # a server still loading answers nowhere: nothing says it listens only on loopback
    loading = fleet_url(identity(), one_machine=False, addresses=lan, connects=lambda u: False)
    assert loading == "http://gpu-a:30000"


@pytest.mark.parametrize(
    ("addresses", "why"),
    [([], "does not resolve"), (["127.0.1.1"], "resolves to 127.0.1.1 (loopback)")],
)
def test_a_loopback_url_the_fleet_cannot_reach_is_refused_with_servers_add(
    addresses: list[str], why: str
) -> None:
    with pytest.raises(IdentityRefused) as refused:
        fleet_url(identity(), one_machine=False, addresses=lambda h: addresses)
    message = str(refused.value)
    assert f"the node name gpu-a {why}" in message
    assert "`tokenmill servers add gpu-a:30000 http://HOST:30000`" in message


def test_a_server_that_answers_only_on_loopback_is_refused() -> None:
    def connects(url: str) -> bool:
        return "localhost" in url

    with pytest.raises(IdentityRefused) as refused:
        fleet_url(identity(), one_machine=False, addresses=lan, connects=connects)
    message = str(refused.value)
    assert "answers on http://localhost:30000 but not on http://gpu-a:30000" in message
    assert "--host 0.0.0.0" in message and "tokenmill servers add gpu-a:30000" in message


def test_a_running_worker_of_the_same_name_refuses_the_second() -> None:
    mine = identity()
    with pytest.raises(IdentityRefused) as refused:
        check_names(mine, None, lambda names: {mine.worker_name} & set(names))
    message = str(refused.value)
    assert "a worker named gpu-a:30000@gpu-a is already running" in message
    assert "-n gpu-a:30000-2@gpu-a" in message


def test_a_server_served_from_another_node_refuses_its_name() -> None:
    mine = identity(server_name="gpu", node="gpu-b")
    theirs = server("gpu", "gpu-a", ["gpu@gpu-a"])
    asked: list[list[str]] = []

    def alive(names: list[str]) -> set[str]:
        asked.append(names)
        return {"gpu@gpu-a"}

    with pytest.raises(IdentityRefused) as refused:
        check_names(mine, theirs, alive)
    assert asked == [["gpu@gpu-b", "gpu@gpu-a"]]
    message = str(refused.value)
    assert "server gpu is served from node gpu-a (workers gpu@gpu-a)" in message
    assert "TOKENMILL_SERVER_NAME" in message and "TOKENMILL_NODE_NAME=gpu-a" in message


def test_no_refusal_for_gone_workers_the_same_node_or_a_broker_that_cannot_tell() -> None:
    mine = identity(server_name="gpu", node="gpu-b")
    check_names(mine, server("gpu", "gpu-a", ["gpu@gpu-a"]), lambda names: set())  # gone
    same_node = server("gpu", "gpu-b", ["gpu-2@gpu-b"])  # a second worker of it, running
    check_names(mine, same_node, lambda names: {"gpu-2@gpu-b"})

    def cannot(names: list[str]) -> set[str]:
        raise OSError("no remote control")

    check_names(mine, None, cannot)
