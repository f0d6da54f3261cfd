"""`tokenmill status`, `servers` and `events` as an operator reads them in an 80-column terminal
or a pipe: names, URLs and numbers are never cut, columns that do not fit are left out in the
order each table states (and said so), a server's last error is shown only while it is
current, and the waiting column appears only when a run has later turns."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import update

from app.ledger import common, event_log, registry
from tests.conftest import migrated_sqlite
from tests.support.procs import clean_env, tokenmill
from tests.support.runs import add_item, make_run

LONG_RUN = "kimi-k25-regen-2026-11-30-shard-07"


def run_tokenmill(data_dir: Path, *args: str, columns: int = 80) -> tuple[list[str], str]:
    result = tokenmill(list(args), clean_env(data_dir, COLUMNS=str(columns)))
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines(), result.stderr


def header_of(lines: list[str]) -> list[str]:
    return " ".join(lines[: lines.index(next(x for x in lines if "───" in x))]).split()


def test_names_and_numbers_are_whole_and_waiting_shows_only_when_used(
    tmp_path: Path, sqlite_template: Path
) -> None:
    engine = migrated_sqlite(sqlite_template, tmp_path / "ledger.sqlite3")
    with engine.begin() as conn:
        run = make_run(conn, LONG_RUN)
        for i in range(12):
            add_item(conn, run.id, f"k{i}", completion_tokens=1_234_567)
        add_item(conn, run.id, "p", status="pending")
    lines, err = run_tokenmill(tmp_path, "status")
    assert all(len(line) <= 80 for line in lines), lines
    # 34 characters of run name: queued and leased go first, as status's help says
    assert header_of(lines) == ["run", "total", "pend", "done", "failed", "trunc", "out", "tokens"]
    row = next(line for line in lines if LONG_RUN in line)
    assert row.split() == [LONG_RUN, "13", "1", "12", "0", "0", str(12 * 1_234_567)]
    assert "left out at 80 columns: queued, leased" in err
    assert "wait" not in "".join(lines)

    with engine.begin() as conn:
        conn.execute(
            update(common.items).where(common.items.c.item_key == "p").values(status="waiting")
        )
    lines, err = run_tokenmill(tmp_path, "status")
    assert all(len(line) <= 80 for line in lines), lines
    assert header_of(lines) == ["run", "total", "wait", "done", "failed", "trunc", "out", "tokens"]
    assert "left out at 80 columns: queued, leased, pend;" in err
    row = next(line for line in lines if LONG_RUN in line)
    assert row.split() == [LONG_RUN, "13", "1", "12", "0", "0", "14814804"]

    short = tmp_path / "short"
    short.mkdir()
    engine = migrated_sqlite(sqlite_template, short / "ledger.sqlite3")
    with engine.begin() as conn:
        add_item(conn, make_run(conn, "r1").id, "k", completion_tokens=5)
    lines, err = run_tokenmill(short, "status")
    assert "queued" in header_of(lines) and "left out" not in err  # it fits: all of it


NAME = "localhost:30000"  # what a worker names its server from a loopback URL
URL = "http://gpu-node-a.cluster.example.internal:30000"


def test_servers_keep_names_and_urls_whole_and_show_only_a_current_error(
    tmp_path: Path, sqlite_template: Path
) -> None:
    engine = migrated_sqlite(sqlite_template, tmp_path / "ledger.sqlite3")
    with engine.begin() as conn:
        for name in (NAME, "gpu-b"):
            registry.upsert_server(conn, name, URL.replace("node-a", name.split(":")[0]))
        probe = {"failures": 0, "successes": 0, "latency_s": None}
        # gpu-b's last probe failed; localhost:30000 was refused once and is healthy again
        registry.record_probe(
            conn, NAME, state="down", ok=False, error="Connection refused", **probe
        )
        registry.record_probe(conn, NAME, state="healthy", ok=True, error=None, **probe)
        registry.record_probe(conn, "gpu-b", state="down", ok=False, error="timed out", **probe)
        event_log.record_event(conn, "down", "a message long enough to fold " * 4, server="gpu-b")
    lines, err = run_tokenmill(tmp_path, "servers")
    assert all(len(line) <= 80 for line in lines), lines
    text = "\n".join(lines)
    assert NAME in text and URL.replace("node-a", "localhost") in text
    assert "local…" not in text and "http:…" not in text
    # a summary line over the table
    assert lines[0] == "2 servers: 1 down, 1 healthy; 0 paused; 0 workers; 0 leased"
    assert header_of(lines[1:]) == ["name", "url", "state"]
    # the columns that say nothing here (no parity checked, no weights read, no worker, every
    # run served) go first, then the others in their order
    assert (
        "left out at 80 columns: rendering, weights, window, not serving, "
        "last probe, workers, leased, last error, paused;" in err
    ), err

    lines, err = run_tokenmill(tmp_path, "servers", columns=200)
    assert "left out" not in err
    rows = {line.split()[0]: line for line in lines[3:]}
    assert rows["gpu-b"].rstrip().endswith("timed out")  # its last probe failed: current
    assert "Connection refused" not in rows[NAME]  # history: the server is healthy again
    assert rows[NAME].split()[2] == "healthy"

    lines, _ = run_tokenmill(tmp_path, "events")
    assert all(len(line) <= 80 for line in lines), lines
    message = " ".join(("a message long enough to fold " * 4).split())
    assert message in " ".join(" ".join(line.split()[3:]) for line in lines[2:4] if line) or (
        message in " ".join(" ".join(lines[2:]).split())
    )
    assert len([line for line in lines[2:] if line.startswith(" ")]) >= 1  # folded, not cut


def test_the_binding_of_a_tokenmill_run_run_is_said_while_it_has_work_left(
    tmp_path: Path, sqlite_template: Path
) -> None:
    """`served by tokenmill run only` beside a run with work left; a finished run's binding is
    in --json only (the table stays the table, however many such runs the ledger holds)."""
    import json

    from app.core.models import runs
    from app.ledger import run_queries

    engine = migrated_sqlite(sqlite_template, tmp_path / "ledger.sqlite3")
    with engine.begin() as conn:
        for name, status in (("finished", "done"), ("going", "pending")):
            run = make_run(conn, name)
            conn.execute(
                update(runs).where(runs.c.id == run.id).values(driver=run_queries.DRIVER_RUN)
            )
            add_item(conn, run.id, "k0")
            add_item(conn, run.id, "k1", status=status)
    lines, _ = run_tokenmill(tmp_path, "status")
    assert [line for line in lines if "served by" in line] == [
        "run going: served by `tokenmill run` only (its --server URLs; the fleet leaves it alone)"
    ]
    shown = tokenmill(["status", "finished", "--json"], clean_env(tmp_path))
    assert json.loads(shown.stdout)["served_by"] == {"driver": "run", "servers": None}


def test_status_names_the_servers_that_do_not_serve_a_run_and_why(
    tmp_path: Path, sqlite_template: Path
) -> None:
    """A server whose workers last found they do not serve a run (its limits, its fingerprint)
    is named under the table with why, and in --json, while the run has work left; a later pin
    by the same server (it serves the run again) takes it away."""
    import json

    from app.core.constants import EVENT_FINGERPRINT_MISMATCH, EVENT_FINGERPRINT_PINNED
    from app.core.models import runs

    why = "its limits do not admit the largest request: context_length 1024 < 2,080"
    engine = migrated_sqlite(sqlite_template, tmp_path / "ledger.sqlite3")
    with engine.begin() as conn:
        for name, status in (("going", "pending"), ("finished", "done")):
            run = make_run(conn, name)
            conn.execute(
                update(runs).where(runs.c.id == run.id).values(fingerprint={"model_path": "m"})
            )
            add_item(conn, run.id, "k0", status=status)
            message = f"server gpu-b does not serve run {name}: {why}"
            event_log.record_event(
                conn, EVENT_FINGERPRINT_MISMATCH, message, run_id=run.id, server="gpu-b"
            )
    _, err = run_tokenmill(tmp_path, "status", columns=200)
    said = " ".join(err.split())
    assert f"run going: server gpu-b does not serve it: {why}" in said, err
    assert "run finished: server" not in said  # no work left: nothing to serve
    shown = tokenmill(["status", "going", "--json"], clean_env(tmp_path))
    assert json.loads(shown.stdout)["not_served_by"] == {"gpu-b": why}

    with engine.begin() as conn:
        going = conn.execute(runs.select().where(runs.c.name == "going")).one()
        event_log.record_event(
            conn, EVENT_FINGERPRINT_PINNED, "pinned", run_id=going.id, server="gpu-b"
        )
    _, err = run_tokenmill(tmp_path, "status", columns=200)
    assert "does not serve" not in err, err
