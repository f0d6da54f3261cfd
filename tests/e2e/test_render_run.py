"""`tokenmill run --render-with URL` end to end, in real processes: every prompt of every turn
of a `--turns all` run is the server's rendering of its stored turns (later turns rendered
when they become ready), the run has a `parity` event, and `--require-parity` refuses servers
that render differently."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from emulator.config import EmulatorConfig
from tests.support.emulator import EmulatorProcess, running_emulator
from tests.support.procs import clean_env, tokenmill
from tests.support.rows import agentic_rows, chat_rows, write_rows
from tests.support.templates import thinking_off_by_default

FAST: dict[str, Any] = {"median_tokens": 12.0, "sigma": 0.3, "step_ms": 1.0}


@pytest.fixture
def same(kimi_tokenizer_dir: Path) -> Iterator[EmulatorProcess]:
    with running_emulator(EmulatorConfig(port=0, tokenizer=str(kimi_tokenizer_dir), **FAST)) as p:
        yield p


def test_run_renders_every_turn_on_the_server(
    tmp_path: Path, kimi_tokenizer_dir: Path, same: EmulatorProcess
) -> None:
    """Rendered by a server whose template differs from the local one (thinking off), every
    prompt, later turns included, is that server's: parity equal there, different locally."""
    folder = thinking_off_by_default(kimi_tokenizer_dir, tmp_path / "off")
    env = clean_env(tmp_path / "data")
    rows = write_rows(tmp_path / "rows.jsonl", chat_rows(16, tools=False))
    with running_emulator(EmulatorConfig(port=0, tokenizer=str(folder), **FAST)) as off:
        args = ["run", str(rows), "--run", "rendered", "--tokenizer", str(kimi_tokenizer_dir)]
        args += ["--server", same.url, "--render-with", off.url, "--turns", "all"]
        run = tokenmill([*args, "--max-new-tokens", "24", "--json"], env)
        assert run.returncode == 0, run.stderr
        counts = json.loads(run.stdout)
        assert counts["done"] == counts["total"] > 16  # the multi-turn rows made later turns
        parity = tokenmill(["parity", "rendered", "--server", off.url, "--json"], env)
        assert parity.returncode == 0, parity.stderr
        report = json.loads(parity.stdout)
        assert report["checked"] == counts["total"] and report["mismatched"] == 0
    local = tokenmill(["parity", "rendered", "--server", same.url, "--json"], env)
    assert local.returncode == 1
    mismatches = json.loads(local.stdout)["mismatches"]
    assert len(mismatches) == counts["total"]
    assert {m["turn"] for m in mismatches} == {0, 1}
    assert all(m["stored"] == "</think>" and m["server"] == "" for m in mismatches)
    # the generation server checked the run's prompts before its first request
    events = json.loads(tokenmill(["events", "--run", "rendered", "--json"], env).stdout)
    assert any(e["kind"] == "parity" for e in events)


def test_run_renders_every_agentic_boundary_on_the_server(
    tmp_path: Path, kimi_tokenizer_dir: Path, same: EmulatorProcess
) -> None:
    """`--turns each` on the agentic corpus, rendered by a server whose template differs from
    the local one (thinking off): every boundary is that server's rendering."""
    folder = thinking_off_by_default(kimi_tokenizer_dir, tmp_path / "off")
    env = clean_env(tmp_path / "data")
    rows = write_rows(tmp_path / "rows.jsonl", agentic_rows(40))
    with running_emulator(EmulatorConfig(port=0, tokenizer=str(folder), **FAST)) as off:
        args = ["run", str(rows), "--run", "agents", "--tokenizer", str(kimi_tokenizer_dir)]
        args += ["--server", same.url, "--render-with", off.url, "--turns", "each"]
        run = tokenmill([*args, "--max-new-tokens", "24", "--json"], env)
        assert run.returncode == 0, run.stderr
        counts = json.loads(run.stdout)
        assert counts["done"] == counts["total"] == 120
        parity = tokenmill(["parity", "agents", "--server", off.url, "--json"], env)
        assert parity.returncode == 0, parity.stderr
        assert json.loads(parity.stdout)["equal"] == 120
    # the local template differs wherever a row does not turn thinking off itself
    local = tokenmill(["parity", "agents", "--server", same.url, "--json"], env)
    assert local.returncode == 1
    thinking_off = [i for i in range(40) if i % 5 == 2]
    assert json.loads(local.stdout)["mismatched"] == 120 - 3 * len(thinking_off)


def test_require_parity_refuses_a_server_that_renders_differently(
    tmp_path: Path, kimi_tokenizer_dir: Path, same: EmulatorProcess
) -> None:
    folder = thinking_off_by_default(kimi_tokenizer_dir, tmp_path / "off")
    env = clean_env(tmp_path / "data")
    rows = write_rows(tmp_path / "rows.jsonl", chat_rows(6))
    with running_emulator(EmulatorConfig(port=0, tokenizer=str(folder), **FAST)) as off:
        run = tokenmill(
            [
                "run",
                str(rows),
                "--run",
                "strict",
                "--tokenizer",
                str(kimi_tokenizer_dir),
                "--server",
                off.url,
                "--render-with",
                same.url,
                "--require-parity",
            ],
            env,
        )
    assert run.returncode == 2
    assert "renders the prompts of run strict differently" in run.stderr
    status = json.loads(tokenmill(["status", "strict", "--json"], env).stdout)
    assert status["done"] == 0 and status["pending"] == 6
