"""A new user's first hour through the real CLI in subprocesses: the ledger and broker each
command uses are named, a typo'd setting or option is one line (never a traceback), an input
with no usable prompt leaves no run, exports refuse bad paths, and `tokenmill delete`."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from app.outputs.export import current_umask
from ops.emulator_proc import start_emulator
from tests.support.procs import ROOT, clean_env, run_args, tokenmill
from tests.support.rows import prompt_rows, write_rows

pytestmark = pytest.mark.e2e


def own_lines(stderr: str) -> list[str]:
    """stderr without transformers' notice about PyTorch."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("[transformers]")]


def one_error(result: subprocess.CompletedProcess[str], *says: str) -> str:
    """The command failed with exactly one `error:` line (saying all of says), no traceback."""
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr and "Aborted" not in result.stderr, result.stderr
    errors = [ln for ln in own_lines(result.stderr) if ln.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    assert all(part in errors[0] for part in says), errors[0]
    return errors[0]


def enqueue(
    tmp_path: Path, tokenizer: Path, run: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """`tokenmill enqueue` of six prompts into run."""
    prompts = write_rows(tmp_path / "p.jsonl", prompt_rows(6))
    return tokenmill(
        ["enqueue", str(prompts), "--run", run, "--tokenizer", str(tokenizer)], env, tmp_path
    )


def test_the_embedded_ledger_and_broker_are_named(tmp_path: Path, kimi_tokenizer_dir: Path) -> None:
    env = clean_env(tmp_path / "data")
    ledger_file = tmp_path / "data" / "ledger.sqlite3"
    status = tokenmill(["status"], env, tmp_path)
    assert status.returncode == 0, status.stderr
    assert f"ledger: {ledger_file} (the embedded default" in status.stderr
    assert f"no runs in the ledger {ledger_file}" in status.stderr

    enqueued = enqueue(tmp_path, kimi_tokenizer_dir, "r1", env)
    assert enqueued.returncode == 0, enqueued.stderr
    assert (
        f"broker: the folder {tmp_path / 'data' / 'broker'} (the embedded default"
        in enqueued.stderr
    )
    assert f"into ledger {ledger_file}, broker the folder" in enqueued.stderr
    # each row's id is its item key, not a part of its prompt
    lines = enqueued.stderr.splitlines()
    assert "fields prompts built from: prompt (6 rows)" in lines, lines
    assert "fields item keys from: id (6 rows)" in lines, lines


def test_an_input_with_no_usable_prompt_leaves_no_run(
    tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    env = clean_env(tmp_path / "data")
    binary = tmp_path / "python.bin"
    binary.write_bytes(Path(sys.executable).resolve().read_bytes()[:40_000])
    result = tokenmill(
        ["enqueue", str(binary), "--run", "bin", "--tokenizer", str(kimi_tokenizer_dir)],
        env,
        tmp_path,
    )
    one_error(result, "no prompt of", "could be used", "run bin was not created")
    assert result.returncode == 2
    assert json.loads(tokenmill(["status", "--json"], env, tmp_path).stdout) == []


def test_typos_in_settings_and_options(tmp_path: Path, kimi_tokenizer_dir: Path) -> None:
    env = clean_env(tmp_path / "data")
    typo = tokenmill(["status"], env | {"TOKENMILL_INFLIGTH": "8"}, tmp_path)
    assert typo.returncode == 0, typo.stderr
    assert "TOKENMILL_INFLIGTH is not a tokenmill setting" in typo.stderr
    assert "did you mean TOKENMILL_INFLIGHT?" in typo.stderr

    level = tokenmill(["--log-level", "verbose", "status"], env, tmp_path)
    assert level.returncode == 2 and "Invalid value for '--log-level'" in level.stderr

    # a misspelt broker scheme: refused before anything is inserted
    broker = enqueue(
        tmp_path,
        kimi_tokenizer_dir,
        "b",
        env | {"TOKENMILL_BROKER_URL": "redsi://127.0.0.1:6379/0"},
    )
    one_error(broker, "TOKENMILL_BROKER_URL", "did you mean redis://?")
    assert json.loads(tokenmill(["status", "--json"], env, tmp_path).stdout) == []

    # an unreachable broker: reconcile cannot tell what it lost, and says so with its exit code
    unreachable = tokenmill(
        ["reconcile"], env | {"TOKENMILL_BROKER_URL": "redis://127.0.0.1:1/0"}, tmp_path
    )
    one_error(unreachable, "the broker redis://127.0.0.1:1/0 cannot be read")


def test_an_invalid_setting_stops_a_celery_worker_in_one_line(tmp_path: Path) -> None:
    env = clean_env(tmp_path / "data", TOKENMILL_INFLIGHT="abc")
    result = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "app", "worker", "--pool", "solo"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in output, output
    assert own_lines(output) == [
        "error: invalid configuration: TOKENMILL_INFLIGHT: give 'auto' or a number from 1 to "
        "4096, not 'abc'"
    ]


def test_exports_refuse_bad_paths_and_write_one_mode(
    tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    env = clean_env(tmp_path / "data")
    emulator = start_emulator(["--step-ms", "1", "--median-tokens", "10"])
    try:
        prompts = write_rows(tmp_path / "p.jsonl", prompt_rows(6))
        run = tokenmill(run_args(prompts, "r1", kimi_tokenizer_dir, [emulator.url]), env, tmp_path)
    finally:
        emulator.stop()
    assert run.returncode == 0, run.stderr

    folder = tmp_path / "exports"
    folder.mkdir()
    one_error(
        tokenmill(["export", "r1", "--out", str(folder)], env, tmp_path),
        "it is a folder; name a file in it",
    )
    missing = tmp_path / "missing" / "dir" / "x.jsonl"
    one_error(
        tokenmill(["export", "r1", "--out", str(missing)], env, tmp_path),
        "does not exist; create it first",
    )
    one_error(
        tokenmill(
            ["export", "r1", "--format", "parquet", "--out", str(missing.parent)], env, tmp_path
        ),
        "does not exist; create it first",
    )
    assert not (tmp_path / "missing").exists()

    jsonl = folder / "r1.jsonl"
    assert tokenmill(["export", "r1", "--out", str(jsonl)], env, tmp_path).returncode == 0
    parquet = folder / "r1.parquet"
    result = tokenmill(
        ["export", "r1", "--format", "parquet", "--out", str(parquet)], env, tmp_path
    )
    assert result.returncode == 0, result.stderr
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [jsonl, *parquet.iterdir()]}
    assert set(modes.values()) == {0o666 & ~current_umask()}, modes


def test_delete_refuses_work_in_flight_unless_forced(
    tmp_path: Path, kimi_tokenizer_dir: Path
) -> None:
    env = clean_env(tmp_path / "data")
    for name in ("gone", "kept"):
        result = enqueue(tmp_path, kimi_tokenizer_dir, name, env)
        assert result.returncode == 0, result.stderr
    # an enqueue publishes its items: they are queued, a worker may take them
    one_error(tokenmill(["delete", "gone"], env, tmp_path), "work in flight", "6 queued", "--force")
    deleted = tokenmill(["delete", "gone", "--force"], env, tmp_path)
    assert deleted.returncode == 0, deleted.stderr
    assert "deleted run gone: 6 items, 0 compacted shards and its events" in deleted.stderr
    runs = json.loads(tokenmill(["status", "--json"], env, tmp_path).stdout)
    assert [r["run"] for r in runs] == ["kept"]
    events = tokenmill(["events", "--run", "gone"], env, tmp_path)
    assert events.returncode != 0  # no such run any more
    one_error(tokenmill(["delete", "gone"], env, tmp_path), "no run named 'gone'")


def test_a_missing_input_file_is_the_first_thing_said(tmp_path: Path) -> None:
    """A typo'd input path is named before anything else is looked at: not the tokenizer (a
    missing one here), not the broker, not a --server (one that nothing listens on)."""
    env = clean_env(tmp_path / "data")
    missing = tmp_path / "promtps.jsonl"
    expected = f"error: cannot open the prompts file {str(missing)!r}: No such file or directory"
    tokenizer = str(tmp_path / "no-tokenizer")
    enqueued = tokenmill(["enqueue", str(missing), "--run", "r1", "--tokenizer", tokenizer], env)
    run = tokenmill(
        ["run", str(missing), "--run", "r1", "--tokenizer", tokenizer, "--server",
         "http://127.0.0.1:9"],
        env,
    )  # fmt: skip
    for result in (enqueued, run):
        assert result.returncode == 2, result.stderr
        assert own_lines(result.stderr) == [expected], result.stderr
    assert not (tmp_path / "data" / "ledger.sqlite3").exists()
