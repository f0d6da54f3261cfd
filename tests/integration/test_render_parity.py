"""Rendering on the server and parity, against real emulator processes: `--render-with`
stores exactly the server's rendering, an outage during it loses and duplicates nothing,
`tokenmill parity` finds a same-template server equal and a different one mismatched (with a
readable diff), and the watchdog's preflight records a `parity` event and pauses a differing
server of a `--require-parity` run."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import Engine, func, select

from app.core.constants import EVENT_ENQUEUE_STOPPED, EVENT_PARITY, PAUSED_BY_PARITY
from app.core.contracts import SamplingParams
from app.core.errors import RetryableError, RunMismatch
from app.core.settings import Settings, get_settings
from app.ledger import common, reads, registry, run_queries
from app.prompts.tokenization import ChatTokenizer
from app.sglang.render import (
    RenderClient,
    RenderPolicy,
    RenderRequest,
    RenderServerUnavailable,
    prompt_request,
)
from emulator.config import EmulatorConfig
from ops.cli import cli
from tests.support.emulator import EmulatorProcess, free_port, running_emulator, start_emulator
from tests.support.procs import clean_env, tokenmill
from tests.support.rows import agentic_rows, chat_rows, write_rows
from tests.support.templates import thinking_off_by_default
from workers.control.parity import ParityGate, check_run
from workers.control.watchdog import run_watchdog
from workers.intake import producer
from workers.intake.reading import CHUNK_LINES

FAST: dict[str, Any] = {"median_tokens": 8.0, "token_min": 300, "token_max": 400, "step_ms": 1.0}


@pytest.fixture(scope="module")
def same(kimi_tokenizer_dir: Path) -> Iterator[EmulatorProcess]:
    """An emulator serving the same tokenizer folder as the runs use."""
    with running_emulator(EmulatorConfig(port=0, tokenizer=str(kimi_tokenizer_dir), **FAST)) as p:
        yield p


@pytest.fixture(scope="module")
def off(kimi_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """An emulator whose template thinks only when asked (the runs' thinks unless told not to)."""
    folder = thinking_off_by_default(kimi_tokenizer_dir, tmp_path_factory.mktemp("off") / "tok")
    with running_emulator(EmulatorConfig(port=0, tokenizer=str(folder), **FAST)) as p:
        yield p


@pytest.fixture(scope="module")
def bare() -> Iterator[EmulatorProcess]:
    """An emulator started without --tokenizer: /v1/tokenize refuses every chat (HTTP 400)."""
    with running_emulator(EmulatorConfig(port=0, **FAST)) as p:
        yield p


@pytest.fixture(scope="module")
def tokenizer(kimi_tokenizer: ChatTokenizer) -> ChatTokenizer:
    return kimi_tokenizer


def client(url: str, wait_s: float = 5.0, window: int = 8) -> RenderClient:
    return RenderClient(
        url,
        window=window,
        connect_timeout_s=2,
        timeout_s=30,
        policy=RenderPolicy(wait_s=wait_s, backoff_s=0.1, backoff_max_s=0.5),
    )


def options(path: Path, run: str, render_with: str | None, **extra: Any) -> producer.EnqueueOptions:
    return producer.EnqueueOptions(
        input_path=path,
        run=run,
        sampling=SamplingParams(max_new_tokens=16, seed=1),
        render_with=render_with,
        **extra,
    )


def stored(db: Engine, run: str) -> list[reads.StoredItem]:
    with db.connect() as conn:
        info = run_queries.get_run(conn, run)
        return reads.stored_prompts(conn, reads.prompt_item_ids(conn, info.id))


# --- --render-with --------------------------------------------------------------------------


def test_render_with_stores_the_servers_rendering(
    db: Engine, tmp_path: Path, same: EmulatorProcess, tokenizer: ChatTokenizer
) -> None:
    path = write_rows(tmp_path / "rows.jsonl", chat_rows(40))
    with client(same.url) as renderer:
        report = producer.enqueue(
            db, tokenizer, options(path, "rw", same.url), publish=None, renderer=renderer
        )
        assert (report.inserted, report.skipped) == (40, 0)
        rows = stored(db, "rw")
        assert len(rows) == 40
        for item in rows:
            request = prompt_request(item.messages or [], {})
            assert item.prompt_ids == renderer.render(request)
            # the same tokenizer folder on both sides: the client's own templating agrees
            assert item.prompt_ids == tokenizer.apply(item.messages or [])
    with db.connect() as conn:
        assert run_queries.get_run(conn, "rw").generation.render_with == same.url
    # pinned: enqueueing into the run with local templating is refused
    with pytest.raises(RunMismatch, match="render with"):
        producer.enqueue(db, tokenizer, options(path, "rw", None), publish=None)


def test_render_with_through_a_different_template_stores_that_template(
    db: Engine, tmp_path: Path, off: EmulatorProcess, tokenizer: ChatTokenizer
) -> None:
    """The server decides: its template (thinking off) builds the prompts, not the local one."""
    path = write_rows(tmp_path / "rows.jsonl", chat_rows(8))
    with client(off.url) as renderer:
        producer.enqueue(
            db, tokenizer, options(path, "off", off.url), publish=None, renderer=renderer
        )
    think, think_end = tokenizer.think_start_id, tokenizer.think_end_id
    for item in stored(db, "off"):
        assert item.prompt_ids[-2:] == [think, think_end]
        assert item.prompt_ids != tokenizer.apply(item.messages or [])


def _count(db: Engine, run: str) -> tuple[int, int]:
    with db.connect() as conn:
        run_id = run_queries.get_run(conn, run).id
        total = conn.execute(
            select(func.count()).where(common.items.c.run_id == run_id)
        ).scalar_one()
        keys = conn.execute(
            select(func.count(func.distinct(common.items.c.item_key))).where(
                common.items.c.run_id == run_id
            )
        ).scalar_one()
    return int(total), int(keys)


def _restart_on(port: int, tokenizer_dir: Path) -> EmulatorProcess:
    process = start_emulator(EmulatorConfig(port=port, tokenizer=str(tokenizer_dir), **FAST))
    process.wait_ready(60)
    return process


class KillingClient(RenderClient):
    """A render client that SIGKILLs its server once `after` prompts were rendered (then runs
    `then`), and counts the renders the outage refused: the outage falls mid-enqueue, on the
    render side, whatever the producer's pipelining."""

    def __init__(
        self, server: EmulatorProcess, *, after: int, wait_s: float, then: Any = None
    ) -> None:
        super().__init__(
            server.url,
            window=8,
            connect_timeout_s=2,
            timeout_s=30,
            policy=RenderPolicy(wait_s=wait_s, backoff_s=0.1, backoff_max_s=0.5),
        )
        self.server, self.after, self.then = server, after, then
        self.rendered = self.refused = 0
        self._count_lock = threading.Lock()

    def render(self, request: RenderRequest) -> list[int]:
        try:
            ids = super().render(request)
        except RetryableError:
            with self._count_lock:
                self.refused += 1
            raise
        with self._count_lock:
            self.rendered += 1
            kill = self.rendered == self.after
        if kill:
            self.server.popen.kill()
            self.server.popen.wait()
            if self.then is not None:
                threading.Thread(target=self.then, daemon=True).start()
        return ids


def test_an_outage_longer_than_the_wait_stops_and_a_rerun_completes(
    db: Engine, tmp_path: Path, kimi_tokenizer_dir: Path, tokenizer: ChatTokenizer
) -> None:
    lines = CHUNK_LINES * 2 + 40
    path = write_rows(tmp_path / "rows.jsonl", chat_rows(lines))
    port = free_port()
    server = _restart_on(port, kimi_tokenizer_dir)
    url = server.url
    try:
        # the server dies in the second chunk: the first is stored whole, nothing after it
        after = CHUNK_LINES + 100
        renderer = KillingClient(server, after=after, wait_s=1.0)
        with renderer, pytest.raises(RenderServerUnavailable) as err:
            producer.enqueue(
                db, tokenizer, options(path, "outage", url), publish=None, renderer=renderer
            )
        assert renderer.refused > 0
        assert "Run the same enqueue again" in str(err.value)
        stored, _ = _count(db, "outage")
        assert stored == CHUNK_LINES
        assert f"{stored} items were stored; nothing from line {stored + 1} on" in str(err.value)
        assert _count(db, "outage") == (stored, stored)
        with db.connect() as conn:
            run_id = run_queries.get_run(conn, "outage").id
            kinds = [e.kind for e in registry.list_events(conn, run_id=run_id)]
            assert registry.stopped_enqueues(conn, [run_id]) == {run_id}  # status says so
        assert EVENT_ENQUEUE_STOPPED in kinds

        server = _restart_on(port, kimi_tokenizer_dir)
        with client(url) as again:
            report = producer.enqueue(
                db, tokenizer, options(path, "outage", url), publish=None, renderer=again
            )
            assert report.already_present == stored
            assert report.inserted == lines - stored
            assert _count(db, "outage") == (lines, lines)
            with db.connect() as conn:
                run = run_queries.get_run(conn, "outage")
                assert registry.stopped_enqueues(conn, [run.id]) == set()
            parity = check_run(db, run, again, server=url)
        assert (parity.checked, parity.equal) == (lines, lines)
    finally:
        server.stop()


def test_an_agentic_enqueue_waits_out_an_outage_and_loses_and_duplicates_nothing(
    db: Engine, tmp_path: Path, kimi_tokenizer_dir: Path, tokenizer: ChatTokenizer
) -> None:
    """`--turns each` on the agentic corpus: the server is killed mid-enqueue and comes back
    a second later; the enqueue waits, then stores every boundary once, as the server renders
    it."""
    rows = 400  # three boundaries each: the outage falls in the second chunk's prompts
    path = write_rows(tmp_path / "rows.jsonl", agentic_rows(rows))
    port = free_port()
    servers = [_restart_on(port, kimi_tokenizer_dir)]
    url = servers[0].url

    def restart_later() -> None:
        time.sleep(1.0)  # the enqueue meets a refused connection meanwhile
        servers.append(_restart_on(port, kimi_tokenizer_dir))

    try:
        renderer = KillingClient(servers[0], after=700, wait_s=120.0, then=restart_later)
        with renderer:
            report = producer.enqueue(
                db,
                tokenizer,
                options(path, "blip", url, turns="each"),
                publish=None,
                renderer=renderer,
            )
            assert renderer.refused > 0 and len(servers) == 2  # it did wait
            assert report.inserted == 3 * rows
            with db.connect() as conn:
                run = run_queries.get_run(conn, "blip")
                keys = conn.execute(
                    select(common.items.c.item_key, common.items.c.turn_index).where(
                        common.items.c.run_id == run.id
                    )
                ).all()
            assert len(keys) == len(set(keys)) == 3 * rows
            assert {turn for _, turn in keys} == {0, 1, 2}
            with db.connect() as conn:
                assert registry.stopped_enqueues(conn, [run.id]) == set()
            parity = check_run(db, run, renderer, server=url)
        assert (parity.checked, parity.equal) == (3 * rows, 3 * rows)
    finally:
        for server in servers:
            server.stop()


# --- tokenmill parity -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory, kimi_tokenizer_dir: Path) -> dict[str, str]:
    """A 40-row run templated locally (embedded ledger), for the CLI."""
    folder = tmp_path_factory.mktemp("cli")
    env = clean_env(folder / "data")
    path = write_rows(folder / "rows.jsonl", chat_rows(40))
    args = ["enqueue", str(path), "--run", "local", "--tokenizer", str(kimi_tokenizer_dir)]
    done = tokenmill(args, env)
    assert done.returncode == 0, done.stderr
    return env


def test_parity_is_equal_on_a_server_with_the_same_template(
    local_run: dict[str, str], same: EmulatorProcess
) -> None:
    done = tokenmill(["parity", "local", "--server", same.url, "--json"], local_run)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report) == {
        "run", "server", "checked", "equal", "mismatched", "mismatches", "versions"
    }  # fmt: skip
    assert (report["checked"], report["equal"], report["mismatched"]) == (40, 40, 0)
    # the client's and the server's versions, side by side
    import transformers

    versions = report["versions"]
    assert versions["client_transformers"] == transformers.__version__
    assert versions["run_transformers"] == transformers.__version__
    assert versions["run_renders_as"] == "5.19.0"
    assert versions["server_sglang"] is not None
    text = tokenmill(["parity", "local", "--server", same.url], local_run)
    assert text.returncode == 0
    assert "40 checked, 40 equal, 0 mismatched" in text.stdout
    assert f"client: transformers {transformers.__version__}" in text.stdout


def test_parity_reports_every_mismatch_with_a_readable_diff(
    local_run: dict[str, str], off: EmulatorProcess, tokenizer: ChatTokenizer
) -> None:
    done = tokenmill(["parity", "local", "--server", off.url, "--json"], local_run)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert (report["checked"], report["equal"], report["mismatched"]) == (40, 0, 40)
    for mismatch in report["mismatches"]:
        # the stored prompt ends by opening the reasoning; the server's closes it at once
        assert mismatch["position"] == mismatch["stored_tokens"]
        assert mismatch["server_tokens"] == mismatch["stored_tokens"] + 1
        assert (mismatch["stored_ids"], mismatch["server_ids"]) == ([], [tokenizer.think_end_id])
        assert (mismatch["stored"], mismatch["server"]) == ("", "</think>")
        assert mismatch["before"].endswith("<|im_assistant|>assistant<|im_middle|><think>")
    text = tokenmill(["parity", "local", "--server", off.url], local_run)
    assert text.returncode == 1
    assert "40 checked, 0 equal, 40 mismatched" in text.stdout
    assert "first difference at token" in text.stdout
    assert "'</think>'" in text.stdout


def test_parity_samples_with_a_seed_and_takes_a_registered_name(
    local_run: dict[str, str], off: EmulatorProcess
) -> None:
    added = tokenmill(["servers", "add", "gpu-off", off.url], local_run)
    assert added.returncode == 0, added.stderr

    def sampled(seed: int) -> list[int]:
        args = ["parity", "local", "--server", "gpu-off", "--sample", "5", "--seed", str(seed)]
        done = tokenmill([*args, "--json"], local_run)
        assert done.returncode == 1, done.stderr
        report = json.loads(done.stdout)
        assert (report["server"], report["checked"]) == ("gpu-off", 5)
        return [m["item"] for m in report["mismatches"]]

    assert sampled(3) == sampled(3)
    assert len({tuple(sampled(seed)) for seed in range(4)}) > 1


def test_parity_on_a_server_that_renders_no_chat_fails_at_once_with_one_line(
    local_run: dict[str, str], bare: EmulatorProcess
) -> None:
    added = tokenmill(["servers", "add", "gpu-bare", bare.url], local_run)
    assert added.returncode == 0, added.stderr
    for server in ("gpu-bare", bare.url):
        done = tokenmill(["parity", "local", "--server", server, "--sample", "200"], local_run)
        assert done.returncode == 2, (done.stdout, done.stderr)
        assert done.stdout == ""
        (line,) = [x for x in done.stderr.splitlines() if x.startswith("error:")]
        assert line.startswith(f"error: {server} cannot render chat prompts: /v1/tokenize refused")
        assert "HTTP 400" in line and "--tokenizer DIR" in line, line
        # one probe, not a refusal per stored prompt
        assert "refused it" not in done.stderr


# --- the preflight ----------------------------------------------------------------------------


class RecordingControl:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []

    def cancel_consumer(self, workers: list[str]) -> None:
        self.calls.append(("cancel", workers))

    def add_consumer(self, workers: list[str]) -> None:
        self.calls.append(("add", workers))


@pytest.mark.parametrize("require_parity", [True, False])
def test_the_watchdog_preflight_records_parity_and_pauses_when_required(
    db: Engine,
    tmp_path: Path,
    same: EmulatorProcess,
    off: EmulatorProcess,
    tokenizer: ChatTokenizer,
    require_parity: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = write_rows(tmp_path / "rows.jsonl", chat_rows(12))
    run_opts = options(path, "pre", None, require_parity=require_parity)
    producer.enqueue(db, tokenizer, run_opts, publish=None)
    with db.begin() as conn:
        registry.upsert_server(conn, "gpu-same", same.url)
        registry.upsert_server(conn, "gpu-off", off.url)
    settings = Settings(data_dir=tmp_path, successes_to_up=1, parity_sample=4)
    control = RecordingControl()
    gate = ParityGate(settings)
    for _ in range(2):  # the second round sees the servers healthy already: no new checks
        assert run_watchdog(db, settings, control, parity=gate) == {
            "gpu-off": "healthy",
            "gpu-same": "healthy",
        }
    with db.connect() as conn:
        run_id = run_queries.get_run(conn, "pre").id
        events = [e for e in registry.list_events(conn, run_id=run_id) if e.kind == EVENT_PARITY]
        same_info = registry.get_server(conn, "gpu-same")
        off_info = registry.get_server(conn, "gpu-off")
    assert sorted(e.server or "" for e in events) == ["gpu-off", "gpu-same"]
    assert same_info.parity and same_info.parity["pre"]["status"] == "equal"
    assert off_info.parity and off_info.parity["pre"]["status"] == "differs"
    assert off_info.parity["pre"]["mismatched"] == off_info.parity["pre"]["checked"] == 4
    assert off_info.differing_runs() == ["pre"]
    assert not same_info.paused
    assert off_info.paused is require_parity
    if require_parity:
        assert off_info.paused_by == PAUSED_BY_PARITY
        assert "pre" in (off_info.pause_reason or "")

    # servers and status name the differing server
    monkeypatch.setenv("TOKENMILL_DATABASE_URL", db.url.render_as_string(hide_password=False))
    monkeypatch.setenv("TOKENMILL_DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    try:
        runner = CliRunner()
        servers = json.loads(runner.invoke(cli, ["servers", "--json"]).output)
        by_name = {s["name"]: s for s in servers}
        assert by_name["gpu-off"]["parity"]["pre"]["status"] == "differs"
        status = json.loads(runner.invoke(cli, ["status", "pre", "--json"]).output)
        assert status["rendering_differs"] == ["gpu-off"]
        table = runner.invoke(cli, ["status"]).output
        assert "server gpu-off renders its prompts differently" in table
    finally:
        get_settings.cache_clear()


def test_the_preflight_on_a_server_that_renders_no_chat_records_one_unchecked_event(
    db: Engine, tmp_path: Path, bare: EmulatorProcess, tokenizer: ChatTokenizer
) -> None:
    path = write_rows(tmp_path / "rows.jsonl", chat_rows(6))
    producer.enqueue(db, tokenizer, options(path, "nochat", None), publish=None)
    with db.begin() as conn:
        registry.upsert_server(conn, "gpu-bare", bare.url)
    settings = Settings(data_dir=tmp_path, successes_to_up=1, parity_sample=4)
    for _ in range(2):  # the second round sees the server healthy already: no new check
        run_watchdog(db, settings, RecordingControl(), parity=ParityGate(settings))
    with db.connect() as conn:
        run_id = run_queries.get_run(conn, "nochat").id
        events = [e for e in registry.list_events(conn, run_id=run_id) if e.kind == EVENT_PARITY]
        info = registry.get_server(conn, "gpu-bare")
    (event,) = events
    assert event.message.startswith("gpu-bare cannot render the prompts of run nochat (HTTP 400")
    assert info.parity and info.parity["nochat"]["status"] == "unchecked"
    assert info.parity["nochat"]["checked"] == 0 and not info.paused


def test_the_preflight_checks_only_runs_the_server_may_serve(
    db: Engine, tmp_path: Path, same: EmulatorProcess, tokenizer: ChatTokenizer
) -> None:
    """A run `tokenmill run` drives, or one bound to other servers, costs a fleet server no
    parity check: it never serves their items."""
    path = write_rows(tmp_path / "rows.jsonl", chat_rows(6))
    producer.enqueue(db, tokenizer, options(path, "fleet", None), publish=None)
    embedded = options(path, "embedded", None, driver=run_queries.DRIVER_RUN)
    producer.enqueue(db, tokenizer, embedded, publish=None)
    with db.begin() as conn:
        registry.upsert_server(conn, "gpu-same", same.url)
        registry.upsert_server(conn, "gpu-other", same.url + "/other")
    bound = options(path, "bound", None, servers=("gpu-other",))
    producer.enqueue(db, tokenizer, bound, publish=None)
    settings = Settings(data_dir=tmp_path, successes_to_up=1, parity_sample=4)
    gate = ParityGate(settings)
    with db.connect() as conn:
        server = registry.get_server(conn, "gpu-same")
    assert gate.blocking_runs(db, server, again=True) == []
    with db.connect() as conn:
        checked = registry.get_server(conn, "gpu-same").parity or {}
    assert set(checked) == {"fleet"}


# --- the agentic corpus as boundary samples ------------------------------------------------------


@pytest.fixture(scope="module")
def agentic_run(
    tmp_path_factory: pytest.TempPathFactory, kimi_tokenizer_dir: Path
) -> dict[str, str]:
    """40 agentic rows as a `--turns each` run templated locally (embedded ledger)."""
    folder = tmp_path_factory.mktemp("agentic")
    env = clean_env(folder / "data")
    path = write_rows(folder / "rows.jsonl", agentic_rows(40))
    args = ["enqueue", str(path), "--run", "agents", "--tokenizer", str(kimi_tokenizer_dir)]
    done = tokenmill([*args, "--turns", "each", "--json"], env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["inserted"] == 120  # two assistant turns + a trailing user
    return env


def test_agentic_boundaries_are_equal_on_a_server_with_the_same_template(
    agentic_run: dict[str, str], same: EmulatorProcess
) -> None:
    done = tokenmill(["parity", "agents", "--server", same.url, "--json"], agentic_run)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["checked"], report["equal"], report["mismatched"]) == (120, 120, 0)


def test_agentic_boundaries_differ_where_the_templates_do(
    agentic_run: dict[str, str], off: EmulatorProcess
) -> None:
    """Rows that turn thinking off render alike on both templates; every other prompt differs
    and is reported."""
    done = tokenmill(["parity", "agents", "--server", off.url, "--json"], agentic_run)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    thinking_off = {f"agent-{i:03d}" for i in range(40) if i % 5 == 2}
    expected = 120 - 3 * len(thinking_off)
    assert (report["checked"], report["mismatched"]) == (120, expected)
    keys = {m["key"] for m in report["mismatches"]}
    assert keys == {f"agent-{i:03d}" for i in range(40)} - thinking_off
    assert sorted(m["turn"] for m in report["mismatches"]) == sorted([0, 1, 2] * len(keys))
    assert all(m["server"] == "</think>" for m in report["mismatches"])
