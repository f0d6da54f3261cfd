"""Reading the READMEs' fleet commands as the as-printed e2e test runs them: continued lines,
comments, the node each command runs on, and the substitutions (hosts, ports, paths only)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import create_engine

from tests.support.procs import ROOT
from tests.support.readme_fleet import Fleet, commands, section_blocks

BLOCK = """\
export TOKENMILL_BROKER_URL=redis://redis-host:6379/0
tokenmill servers add gpu-a http://gpu-a:30000 \\
    --restart-command 'ssh {host} sudo systemctl restart sglang@{port}'   # once
# on gpu-a, next to its SGLang server:
TOKENMILL_SGLANG_URL=http://localhost:30000 TOKENMILL_SERVER_NAME=gpu-a \\
    celery -A app worker -E        # a trailing comment
# from any machine:
TOKENMILL_SGLANG_URL=http://localhost:30000 celery -A app worker -E     # on each GPU node
tokenmill enqueue prompts.jsonl --run r1 --tokenizer /models/Kimi-K2.5
"""


def test_commands_carry_their_environment_and_node() -> None:
    got = [(c.node, c.env, c.argv, c.long_running) for c in commands(BLOCK)]
    url = {"TOKENMILL_SGLANG_URL": "http://localhost:30000"}
    assert got == [
        (None, {}, ["export", "TOKENMILL_BROKER_URL=redis://redis-host:6379/0"], False),
        (
            None,
            {},
            [
                *("tokenmill", "servers", "add", "gpu-a", "http://gpu-a:30000"),
                *("--restart-command", "ssh {host} sudo systemctl restart sglang@{port}"),
            ],
            False,
        ),
        (
            "gpu-a",
            url | {"TOKENMILL_SERVER_NAME": "gpu-a"},
            ["celery", "-A", "app", "worker", "-E"],
            True,
        ),
        ("each", url, ["celery", "-A", "app", "worker", "-E"], True),
        (
            None,
            {},
            [
                "tokenmill",
                "enqueue",
                "prompts.jsonl",
                "--run",
                "r1",
                "--tokenizer",
                "/models/Kimi-K2.5",
            ],
            False,
        ),
    ]


def test_only_hosts_ports_and_paths_are_substituted(tmp_path: Path) -> None:
    fleet = Fleet(
        root=tmp_path,
        db=create_engine("sqlite://"),
        nodes={"gpu-a": 41001, "gpu-b": 41002},
        database_url="postgresql://postgres@127.0.0.1:5432/t",
        broker_url="redis://127.0.0.1:6390/0",
        paths={"prompts.jsonl": "/tmp/p.jsonl", "/models/Kimi-K2.5": "/tmp/tok"},
        emulator_flags=[],
        flower_port=5556,
    )
    sub = fleet.substitute
    assert sub("redis://redis-host:6379/0", None) == "redis://127.0.0.1:6390/0"
    assert sub("postgresql://tokenmill@db-host/tokenmill", None) == fleet.database_url
    assert sub("gpu-b:30000 http://gpu-b:30000", None) == "gpu-b:41002 http://127.0.0.1:41002"
    assert sub("http://localhost:30000", "gpu-a") == "http://localhost:41001"
    assert (
        sub("prompts.jsonl --tokenizer /models/Kimi-K2.5", None)
        == "/tmp/p.jsonl --tokenizer /tmp/tok"
    )
    assert sub("my-prompts.jsonl", None) == "my-prompts.jsonl"  # whole paths only


def test_the_readme_sections_hold_the_fleet() -> None:
    readme = (ROOT / "README.md").read_text()
    distributed = [c for b in section_blocks(readme, "Distributed") for c in commands(b)]
    assert [c.argv[:4] for c in distributed if c.long_running] == [
        ["celery", "-A", "app", "beat"],
        ["celery", "-A", "app", "worker"],
        ["tokenmill", "flower"],
    ]
    assert [c.node for c in distributed if "worker" in c.argv] == ["each"]
    runbook = (ROOT / "ops" / "README.md").read_text()
    start = [c for b in section_blocks(runbook, "Start a fleet") for c in commands(b)]
    assert [c.node for c in start if "worker" in c.argv] == ["each"]
    # one set of names: the worker's naming rule (host:port, a loopback host replaced by the
    # node), as README's fleet
    added = [c.argv[3] for c in start if c.argv[1:3] == ["servers", "add"]]
    assert added == ["gpu-a:30000", "gpu-b:30000"]
    assert not [c for c in start if "TOKENMILL_SERVER_NAME" in c.env]
