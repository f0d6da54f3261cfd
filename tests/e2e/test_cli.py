"""The README's commands through the real CLI in subprocesses: `tokenmill demo` as a newcomer
runs it (no settings, then the commands it prints, exactly as printed, and nothing on stderr
that means nothing to them) and with services configured, and `run` → `status --json` →
`export` against an emulator."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ops.emulator_proc import start_emulator
from tests.support.procs import clean_env, tokenmill

pytestmark = pytest.mark.e2e

# lines that mean nothing to a tokenmill user (transformers without PyTorch, kombu on the
# folder broker)
NOISE = ("PyTorch was not found", "No hostname was supplied")


def printed_commands(stdout: str) -> list[str]:
    """The shell lines the demo ends with."""
    lines = stdout.splitlines()
    start = lines.index("look at the run (from this folder):")
    return [line.strip() for line in lines[start + 1 :] if line.startswith("  ")]


def as_printed(line: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a printed line through bash, `tokenmill` being this checkout's CLI."""
    script = f'tokenmill() {{ {shlex.quote(sys.executable)} -m ops "$@"; }}\n{line}\n'
    return subprocess.run(
        ["bash", "-c", script], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )


def check_printed_commands(stdout: str, env: dict[str, str], cwd: Path) -> list[str]:
    """Run each printed command; return their stderr. Each must exit 0 and do its job."""
    commands = printed_commands(stdout)
    argvs = [shlex.split(line) for line in commands]
    argvs = [argv[argv.index("tokenmill") + 1 :] for argv in argvs]
    assert [argv[0] for argv in argvs] == ["status", "report", "verify", "export"]
    done = [as_printed(line, env, cwd) for line in commands]
    for line, result in zip(commands, done, strict=True):
        assert result.returncode == 0, f"{line}\n{result.stderr}"
    status, report, _verify, export = argvs
    assert status[1] in done[0].stdout  # the run's row
    assert (cwd / report[report.index("--out") + 1] / "index.html").is_file()
    assert "wrote 130 samples" in done[3].stderr  # 61 text and 4 image prompts, 2 samples
    assert (cwd / export[export.index("--out") + 1] / ".manifest.json").is_file()
    return [result.stderr for result in done]


def test_demo_as_a_newcomer_runs_it(tmp_path: Path) -> None:
    env = clean_env(tmp_path / "unused")
    del env["TOKENMILL_DATA_DIR"]  # the default: ./.tokenmill
    result = tokenmill(["demo"], env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "0 mismatches" in result.stderr
    commands = printed_commands(result.stdout)
    # the run is in the ledger every command reads by default: no prefix to type
    assert all(line.startswith("tokenmill ") for line in commands), commands
    errors = [result.stderr, *check_printed_commands(result.stdout, env, tmp_path)]

    # an embedded enqueue publishes to the folder broker
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "q", "prompt": "hello"}) + "\n")
    tokenizer = tmp_path / ".tokenmill" / "tokenizers" / "kimi-k2.5-fixture"
    enqueue = tokenmill(
        ["enqueue", str(prompts), "--run", "e1", "--tokenizer", str(tokenizer)], env, tmp_path
    )
    assert enqueue.returncode == 0, enqueue.stderr
    assert "1 published" in enqueue.stderr
    errors.append(enqueue.stderr)
    for err in errors:
        assert not [line for line in err.splitlines() if any(n in line for n in NOISE)], err


def test_demo_runs_on_embedded_defaults(tmp_path: Path) -> None:
    # point the service URLs nowhere: the demo must not need or touch them
    env = clean_env(tmp_path / "data") | {
        "TOKENMILL_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/x",
        "TOKENMILL_BROKER_URL": "redis://127.0.0.1:1/0",
    }
    result = tokenmill(["demo"], env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "0 mismatches" in result.stderr
    exported = [line for line in result.stdout.splitlines() if line.startswith("specforge:")]
    path = Path(exported[0].split()[1])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows and all(len(r["input_ids"]) == len(r["loss_mask"]) for r in rows)
    assert sum(1 for r in rows if r.get("image_token_counts")) == 8  # its 4 image rows
    # its commands name the demo's own ledger, and work as printed with these settings
    commands = printed_commands(result.stdout)
    assert all(line.startswith("TOKENMILL_DATABASE_URL=sqlite:///") for line in commands)
    check_printed_commands(result.stdout, env, tmp_path)


def test_run_status_export(tmp_path: Path, kimi_tokenizer_dir: Path) -> None:
    env = clean_env(tmp_path / "data")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(
            [json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) for i in range(20)]
            + ["not json", json.dumps({"id": "long", "prompt": "x " * 40})]
        )
        + "\n"
    )
    emulator = start_emulator(["--step-ms", "1", "--median-tokens", "30", "--context-length", "64"])
    try:
        run = tokenmill(
            [
                "run",
                str(prompts),
                "--run",
                "r1",
                "--tokenizer",
                str(kimi_tokenizer_dir),
                "--server",
                emulator.url,
                "--max-new-tokens",
                "40",
                "--json",
            ],
            env,
            tmp_path,
        )
    finally:
        emulator.stop()
    assert run.returncode == 0, run.stderr
    assert "line 21" in run.stderr  # the bad line is named
    status = tokenmill(["status", "r1", "--json"], env, tmp_path)
    counts = json.loads(status.stdout)
    assert {k: counts[k] for k in ("total", "pending", "queued", "leased")} == {
        "total": 21,
        "pending": 0,
        "queued": 0,
        "leased": 0,
    }
    assert counts["done"] + counts["failed"] == 21 and counts["truncated"] >= 1
    assert counts["failed"] >= 1  # prompt + max_new_tokens over the 64-token context: a 400
    out = tmp_path / "r1.jsonl"
    export = tokenmill(["export", "r1", "--format", "specforge", "--out", str(out)], env, tmp_path)
    assert export.returncode == 0, export.stderr
    assert len(out.read_text().splitlines()) == counts["done"]
