"""Saturation's "defaults on a big server" cases (`bench/saturation.py --defaults`): the worker
as the README starts it (no TOKENMILL_INFLIGHT, no TOKENMILL_BATCH_SIZE) against an ideal
constant-window client at each server's capacity, side by side in one run.

Cases (each server emulated with a decode step of max_running / 64 ms, so every one of them
can make 64,000 tokens/s when full, or a fixed --big-step-ms):

  256     one server, --max-running 256;
  512     one server, --max-running 512;
  kv      one server, --max-running 512 and a KV pool (--max-total-tokens) that binds first:
          requests queue on the server while slots are free;
  fleet   two servers of different sizes (--max-running 256 and 128, same step), one worker
          each, one shared queue.

Modes per case: `auto` (the defaults), `ideal` (per server, max_running threads with a
single-connection client each, taking the next prompt from one shared queue at once), and with
--with-fixed `fixed-64` (TOKENMILL_INFLIGHT=64, the old default).

Imported as `saturation_big` by saturation.py (the script's folder is first on sys.path).
"""

from __future__ import annotations

import argparse
import itertools
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bare_client import ClientRun, Request, bare_client_run
from common import (
    REDIS_URL,
    emulator,
    emulator_stats,
    engine_for,
    enqueue_cli,
    run_span,
    service_env,
    start_worker,
    stop_process,
    table,
    wait_run_finished,
)
from meters import CpuMeter

CASES = ("256", "512", "kv", "fleet")
MODES = ("auto", "ideal")


@dataclass(frozen=True)
class Server:
    max_running: int
    kv_tokens: int | None = None


def case_servers(case: str, args: argparse.Namespace) -> list[Server]:
    if case == "256":
        return [Server(256)]
    if case == "512":
        return [Server(512)]
    if case == "kv":
        return [Server(512, args.kv_tokens)]
    if case == "fleet":
        return [Server(256), Server(128)]
    raise ValueError(f"unknown case {case!r}")


def step_ms(case: str, server: Server, args: argparse.Namespace) -> float:
    """The decode step: fixed by --big-step-ms, else max_running / 64 ms (a fleet's servers
    share the step of its biggest, so the bigger one is the faster)."""
    if args.big_step_ms:
        return float(args.big_step_ms)
    biggest = max(s.max_running for s in case_servers(case, args))
    return biggest / 64.0


def emulator_args(case: str, server: Server, args: argparse.Namespace) -> list[str]:
    flags = [
        "--max-running",
        str(server.max_running),
        "--step-ms",
        str(step_ms(case, server, args)),
    ]
    if server.kv_tokens is not None:
        flags += ["--max-total-tokens", str(server.kv_tokens)]
    flags += ["--median-tokens", str(args.median_tokens), "--sigma", str(args.sigma)]
    flags += ["--prefill-ms-per-1k-tokens", str(args.prefill_ms), "--log-level", "WARNING"]
    return flags


def _totals(stats: list[dict[str, Any]]) -> tuple[int, float, float]:
    """(generated tokens, capacity tokens/s, slot occupancy) over the servers of a case; the
    occupancy is the emulators' own view, whatever the client's clock: tokens made per slot
    and step while they were stepping."""
    generated = sum(int(s["generated_tokens"]) for s in stats)
    capacity = sum(float(s["capacity_tokens_per_s"]) for s in stats)
    slot_steps = sum(int(s["busy_steps"]) * int(s["max_running"]) for s in stats)
    return generated, capacity, generated / slot_steps if slot_steps else 0.0


def run_auto(
    case: str,
    args: argparse.Namespace,
    pg_url: str,
    data_dir: Path,
    prompts: Path,
    run: str,
    inflight: str | None,
) -> dict[str, Any]:
    """One fresh run through `celery -A app worker -E` per server, as the README starts it."""
    servers = case_servers(case, args)
    db = engine_for(pg_url)
    enqueue_cli(args, service_env(pg_url, REDIS_URL, data_dir), prompts, run)
    with ExitStack() as stack:
        emus = [stack.enter_context(emulator(emulator_args(case, s, args))) for s in servers]
        workers = []
        for i, emu in enumerate(emus):
            settings = {"TOKENMILL_SGLANG_URL": emu.url}
            if inflight is not None:
                settings["TOKENMILL_INFLIGHT"] = inflight
            env = service_env(pg_url, REDIS_URL, data_dir, **settings)
            workers.append(start_worker(env, f"{run}-{i}", data_dir / f"worker-{run}-{i}.log"))
        pids = {f"worker{i}": w.pid for i, w in enumerate(workers)}
        meter = CpuMeter(pids).start()
        try:
            counts = wait_run_finished(
                db,
                run,
                timeout_s=args.timeout,
                alive=lambda: all(w.poll() is None for w in workers),
            )
            cpu = meter.stop()
            stats = [emulator_stats(e.url) for e in emus]
        finally:
            for w in workers:
                stop_process(w)
    first, last = run_span(db, run)
    db.dispose()
    span_s = (last - first).total_seconds()
    generated, capacity, occupancy = _totals(stats)
    worker_cpu = sum(cpu[name] for name in pids)
    # the run's own tokens: a fleet's servers also make hedges at the end (second copies)
    useful = int(counts.output_tokens)
    return {
        "generated": useful,
        "span_s": span_s,
        "util": useful / span_s / capacity,
        "occupancy": occupancy,
        "cpu_ms_per_item": 1000 * worker_cpu / max(1, counts.done),
        "note": f"done {counts.done}, failed {counts.failed}; worker CPU {worker_cpu:.1f} s; "
        f"the servers made {generated:,} tokens (hedges included)",
    }


def run_ideal(case: str, args: argparse.Namespace, requests: list[Request]) -> dict[str, Any]:
    """Per server a constant window of its max_running, all fed from one shared queue."""
    servers = case_servers(case, args)
    shared = itertools.count()
    with ExitStack() as stack:
        emus = [stack.enter_context(emulator(emulator_args(case, s, args))) for s in servers]
        runs: list[ClientRun] = []
        lock = threading.Lock()

        def drive(url: str, window: int) -> None:
            reqs = [Request(r.input_ids, r.sampling, f"ideal-{case}-{r.rid}") for r in requests]
            result = bare_client_run(url, reqs, window=window, counter=shared)
            with lock:
                runs.append(result)

        threads = [
            threading.Thread(target=drive, args=(e.url, s.max_running), daemon=True)
            for e, s in zip(emus, servers, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = [emulator_stats(e.url) for e in emus]
    errors = [e for r in runs for e in r.errors]
    if errors:
        raise RuntimeError(f"ideal {case}: {len(errors)} errors, first: {errors[0]}")
    span_s = max(max(r.done) for r in runs) - min(min(s for s in r.sent if s > 0) for r in runs)
    generated, capacity, occupancy = _totals(stats)
    return {
        "generated": generated,
        "span_s": span_s,
        "util": generated / span_s / capacity,
        "occupancy": occupancy,
        "cpu_ms_per_item": None,
        "note": "",
    }


def run_cases(
    args: argparse.Namespace,
    pg_url: str,
    data_dir: Path,
    prompts: Path,
    requests: list[Request],
) -> None:
    """Every case of --cases, each mode side by side; the table and each case's ratio."""
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    modes = [*MODES, *(("fixed-64",) if args.with_fixed else ())]
    rows: list[list[Any]] = []
    ratios: list[str] = []
    for case in cases:
        described = " + ".join(
            f"{s.max_running} slots" + (f", KV {s.kv_tokens} tokens" if s.kv_tokens else "")
            for s in case_servers(case, args)
        )
        print(
            f"case {case}: {described}, step {step_ms(case, case_servers(case, args)[0], args)} ms"
        )
        results: dict[str, dict[str, Any]] = {}
        for mode in modes:
            print(f"  running {mode} …", flush=True)
            t0 = time.monotonic()
            if mode == "ideal":
                r = run_ideal(case, args, requests)
            else:
                run = f"defaults-{case}-{mode}"
                inflight = "64" if mode == "fixed-64" else None
                r = run_auto(case, args, pg_url, data_dir, prompts, run, inflight)
            results[mode] = r
            print(
                f"    {mode}: utilization {r['util']:.3f}, {r['span_s']:.1f} s busy span, "
                f"{r['generated']:,} tokens ({time.monotonic() - t0:.0f} s) {r['note']}",
                flush=True,
            )
        ideal = results["ideal"]["util"]
        for mode, r in results.items():
            cpu = r["cpu_ms_per_item"]
            rows.append(
                [case, mode, r["span_s"], r["generated"], r["util"], r["util"] / ideal,
                 r["occupancy"], "-" if cpu is None else cpu]
            )  # fmt: skip
        verdict = "meets" if results["auto"]["util"] / ideal >= 0.95 else "MISSES"
        ratios.append(
            f"{case}: auto / ideal = {results['auto']['util'] / ideal:.3f} ({verdict} 0.95)"
        )
    print()
    headers = ["case", "mode", "busy span s", "generated tok", "utilization", "/ ideal"]
    print(table([*headers, "slot occupancy", "worker CPU ms/item"], rows))
    for line in ratios:
        print(line)
