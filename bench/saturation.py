"""Saturation: how much of an emulated GPU tokenmill keeps busy with heavy-tailed outputs.

Each mode runs against a FRESH emulator with identical settings (64 slots, 1 ms steps,
log-normal output lengths), the same prompt ids and the same sampling:

  tokenmill   `tokenmill enqueue` into Postgres + Redis, then ONE `celery -A app worker`
              with TOKENMILL_INFLIGHT=64 until the ledger says the run is finished;
  batch       a "batch and wait" client: send 64 requests, wait for all 64, repeat;
  ideal       a client that keeps exactly 64 requests in flight (64 threads, each with its
              own single-connection httpx client, taking the next prompt at once);
  tokenmill-shared-ssl
              an EXPERIMENT, not tokenmill as shipped: the same worker, with every httpx
              client it builds sharing one SSL context (see bench/README.md).

Utilization = generated tokens / busy span / emulator capacity (max_running / step), where
the busy span runs from the first request to the last completion: for the bare clients,
first send to last answer; for tokenmill, the ledger's first claim (started_at) to its last
durable write (finished_at), so tokenmill's own overhead counts against it.

    python bench/saturation.py                          # all four modes, ~3 minutes
    python bench/saturation.py --order tokenmill,batch,ideal
    python bench/saturation.py --prompts 500 --order tokenmill,batch,ideal   # quicker

--defaults runs the "defaults on a big server" cases instead (bench/saturation_big.py): the
worker as the README starts it, no TOKENMILL_INFLIGHT, against an ideal client at each
server's capacity, on servers of 256 and 512 slots, one whose KV pool binds first, and a
fleet of two sizes:

    python bench/saturation.py --defaults --prompts 3000 --max-new-tokens 1024
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import saturation_big
from bare_client import Request, bare_client_run
from common import (
    REDIS_URL,
    StatsSampler,
    bench_database,
    emulator,
    emulator_stats,
    engine_for,
    enqueue_cli,
    fixture_tokenizer_dir,
    flush_redis,
    machine_note,
    run_items,
    run_span,
    run_tokenmill,
    service_env,
    start_worker,
    stop_process,
    table,
    wait_first_claim,
    wait_run_finished,
    write_chat_prompts,
)
from meters import CpuMeter, profile_summary, start_profile

RUN = "saturation"
MODES = ("tokenmill", "batch", "ideal", "tokenmill-shared-ssl")
# An experiment, not tokenmill as shipped: the worker runs with this sitecustomize on its
# PYTHONPATH, so every httpx.Client it creates shares one SSL context instead of loading the
# CA bundle again (~18 ms of CPU under the GIL per client, 64 clients at start-up).
SHARED_SSL_SITECUSTOMIZE = """\
import ssl

import httpx

_context = ssl.create_default_context()
_init = httpx.Client.__init__


def _shared_context_init(self, *args, **kwargs):
    kwargs.setdefault("verify", _context)
    _init(self, *args, **kwargs)


httpx.Client.__init__ = _shared_context_init
"""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=2000, help="prompts (one sample each)")
    p.add_argument("--max-running", type=int, default=64, help="emulator batch slots")
    p.add_argument("--inflight", type=int, default=64, help="window of all three clients")
    p.add_argument("--batch-size", type=int, default=8, help="TOKENMILL_BATCH_SIZE")
    p.add_argument("--step-ms", type=float, default=1.0, help="emulator decode step")
    p.add_argument("--median-tokens", type=float, default=256.0, help="median output length")
    p.add_argument("--sigma", type=float, default=1.2, help="log-normal sigma of lengths")
    p.add_argument("--max-new-tokens", type=int, default=4096, help="sampling max_new_tokens")
    p.add_argument("--prefill-ms", type=float, default=2.0, help="emulator prefill ms / 1k")
    p.add_argument("--words", type=int, default=160, help="mean words per prompt")
    p.add_argument("--seed", type=int, default=1, help="prompt and sampling seed")
    p.add_argument(
        "--order",
        default=",".join(MODES),
        help=f"comma-separated modes to run, in order (of {', '.join(MODES)}; the last is "
        "an experiment: the worker's httpx clients share one SSL context)",
    )
    p.add_argument(
        "--tokenmill-inflight", type=int, default=None, help="TOKENMILL_INFLIGHT (--inflight)"
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="folder for a py-spy profile of the worker (collapsed stacks) and its summary",
    )
    p.add_argument("--profile-s", type=int, default=12, help="seconds to profile")
    p.add_argument("--repeat", type=int, default=1, help="rounds of all modes")
    p.add_argument("--ramp", action="store_true", help="print the first 4 s of running counts")
    p.add_argument("--timeout", type=float, default=1800.0, help="per-mode limit, seconds")
    p.add_argument(
        "--defaults",
        action="store_true",
        help="the 'defaults on a big server' cases instead of the modes (saturation_big.py)",
    )
    p.add_argument(
        "--cases", default=",".join(saturation_big.CASES), help="--defaults: cases to run"
    )
    p.add_argument(
        "--kv-tokens", type=int, default=131072, help="--defaults kv: the KV pool in tokens"
    )
    p.add_argument(
        "--big-step-ms",
        type=float,
        default=None,
        help="--defaults: decode step of every server (default: max_running / 64 ms)",
    )
    p.add_argument(
        "--with-fixed",
        action="store_true",
        help="--defaults: also run each case with TOKENMILL_INFLIGHT=64 (the old default)",
    )
    args = p.parse_args()
    args.modes = [m.strip() for m in args.order.split(",") if m.strip()]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes: {', '.join(sorted(unknown))}")
    return args


def emulator_args(args: argparse.Namespace) -> list[str]:
    return [
        "--max-running",
        str(args.max_running),
        "--step-ms",
        str(args.step_ms),
        "--median-tokens",
        str(args.median_tokens),
        "--sigma",
        str(args.sigma),
        "--prefill-ms-per-1k-tokens",
        str(args.prefill_ms),
        "--log-level",
        "WARNING",
    ]


def figures(label: str, span_s: float, stats: dict[str, Any], extra: str = "") -> dict[str, Any]:
    generated = int(stats["generated_tokens"])
    capacity = float(stats["capacity_tokens_per_s"])
    steps = int(stats["busy_steps"])
    return {
        "mode": label,
        "span_s": span_s,
        "generated": generated,
        "tok_s": generated / span_s,
        "capacity": capacity,
        "util": generated / span_s / capacity,
        # emulator-side: share of slot-steps that produced a token while it was stepping
        "occupancy": generated / (steps * int(stats["max_running"])) if steps else 0.0,
        "completed": int(stats["completed"]),
        "extra": extra,
    }


def run_tokenmill_mode(
    args: argparse.Namespace,
    pg_url: str,
    data_dir: Path,
    emu_args: list[str],
    run: str,
    mode: str = "tokenmill",
) -> dict[str, Any]:
    db = engine_for(pg_url)
    with emulator(emu_args) as emu:
        env = service_env(
            pg_url,
            REDIS_URL,
            data_dir,
            TOKENMILL_SGLANG_URL=emu.url,
            TOKENMILL_INFLIGHT=str(args.tokenmill_inflight or args.inflight),
            TOKENMILL_BATCH_SIZE=str(args.batch_size),
        )
        if mode == "tokenmill-shared-ssl":
            site = data_dir / "shared-ssl"
            site.mkdir(exist_ok=True)
            (site / "sitecustomize.py").write_text(SHARED_SSL_SITECUSTOMIZE)
            env["PYTHONPATH"] = str(site)
        log = data_dir / f"worker-{run}.log"
        started = time.monotonic()
        worker = start_worker(env, run, log)
        meter = CpuMeter({"worker": worker.pid, "emulator": emu.popen.pid}, db=db).start()
        profiler = None
        try:
            with StatsSampler(emu.url) as sampler:
                if args.profile is not None:
                    args.profile.mkdir(parents=True, exist_ok=True)
                    wait_first_claim(db, run)
                    profiler = start_profile(
                        worker.pid, args.profile / f"{run}.raw", duration_s=args.profile_s
                    )
                counts = wait_run_finished(
                    db, run, timeout_s=args.timeout, alive=lambda: worker.poll() is None
                )
            whole_s = time.monotonic() - started
            cpu = meter.stop()
            stats = emulator_stats(emu.url)
        finally:
            if profiler is not None:
                profiler.wait()
            stop_process(worker)
    if args.profile is not None:
        summary = profile_summary(args.profile / f"{run}.raw")
        (args.profile / f"{run}-summary.txt").write_text(summary + "\n")
        print(f"  worker profile ({args.profile / f'{run}.raw'}):\n{summary}")
    first, last = run_span(db, run)
    db.dispose()
    span_s = (last - first).total_seconds()
    extra = (
        f"done {counts.done}, failed {counts.failed}, truncated {counts.truncated}; "
        f"{whole_s:.1f} s from worker start; CPU s: worker {cpu['worker']:.1f} (with its "
        f"start-up), postgres {cpu['postgres']:.1f}, emulator {cpu['emulator']:.1f}"
    )
    if counts.failed:
        print(f"  !! {counts.failed} items failed; see {log}")
    result = figures(mode, span_s, stats, extra)
    result["timeline"] = sampler.summary(first.timestamp(), last.timestamp(), args.max_running)
    if args.ramp:
        result["timeline"] += "\n    ramp (s:running): " + sampler.ramp(first.timestamp())
    if counts.output_tokens != result["generated"]:
        print(f"  !! ledger has {counts.output_tokens} tokens, emulator {result['generated']}")
    return result


def run_client_mode(
    mode: str, args: argparse.Namespace, emu_args: list[str], requests: list[Request]
) -> dict[str, Any]:
    with emulator(emu_args) as emu:
        reqs = [Request(r.input_ids, r.sampling, f"{mode}-{r.rid}") for r in requests]
        meter = CpuMeter({"emulator": emu.popen.pid}).start()
        with StatsSampler(emu.url) as sampler:
            run = bare_client_run(emu.url, reqs, window=args.inflight, barrier=mode == "batch")
        cpu = meter.stop()
        stats = emulator_stats(emu.url)
    if run.errors:
        raise RuntimeError(f"{mode}: {len(run.errors)} errors, first: {run.errors[0]}")
    extra = (
        f"{run.wall_s:.1f} s wall; CPU s: client {cpu['bench']:.1f}, emulator {cpu['emulator']:.1f}"
    )
    result = figures(mode, run.span_s, stats, extra)
    result["timeline"] = sampler.summary(min(run.sent), max(run.done), args.max_running)
    if args.ramp:
        result["timeline"] += "\n    ramp (s:running): " + sampler.ramp(min(run.sent))
    return result


def main() -> None:
    args = parse_args()
    print(f"saturation benchmark — {machine_note()}")
    emu_args = emulator_args(args)
    setup = (
        "the workers with the defaults (no TOKENMILL_INFLIGHT, TOKENMILL_BATCH_SIZE)"
        if args.defaults
        else f"emulator: {' '.join(emu_args)}; window {args.inflight}, batch size "
        f"{args.batch_size}, TOKENMILL_INFLIGHT {args.tokenmill_inflight or args.inflight}"
    )
    print(
        f"{args.prompts} prompts (~{args.words} words), max_new_tokens {args.max_new_tokens}, "
        + setup,
        flush=True,
    )
    fixture_tokenizer_dir()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tm-bench-sat-") as tmp, bench_database() as pg_url:
        data_dir = Path(tmp)
        flush_redis()
        try:
            prompts = write_chat_prompts(
                data_dir / "prompts.jsonl", args.prompts, words=args.words, seed=args.seed
            )
            env = service_env(
                pg_url, REDIS_URL, data_dir, TOKENMILL_BATCH_SIZE=str(args.batch_size)
            )
            t0 = time.perf_counter()
            enqueue_cli(args, env, prompts, f"{RUN}-1")
            print(f"enqueued in {time.perf_counter() - t0:.1f} s", flush=True)
            db = engine_for(pg_url)
            items, sampling = run_items(db, f"{RUN}-1")
            db.dispose()
            requests = [
                Request(it.prompt_ids, sampling.for_sample(it.sample_index), str(it.id))
                for it in items
            ]
            mean_prompt = sum(len(r.input_ids) for r in requests) / len(requests)
            print(f"{len(requests)} items, mean prompt {mean_prompt:.0f} tokens", flush=True)
            if args.defaults:
                # that run gave the ideal client its requests: each case enqueues its own
                flush_redis()
                run_tokenmill(["delete", f"{RUN}-1", "--force"], env)
                saturation_big.run_cases(args, pg_url, data_dir, prompts, requests)
                return

            runs = 0
            for rep in range(args.repeat):
                for mode in args.modes:
                    print(f"running {mode} (round {rep + 1}) …", flush=True)
                    if mode.startswith("tokenmill"):
                        runs += 1
                        run = f"{RUN}-{runs}"
                        if runs > 1:  # a fresh run of the same prompts and sampling
                            enqueue_cli(args, env, prompts, run)
                        r = run_tokenmill_mode(args, pg_url, data_dir, emu_args, run, mode)
                    else:
                        r = run_client_mode(mode, args, emu_args, requests)
                    results.append(r)
                    print(
                        f"  {mode}: {r['span_s']:.1f} s busy span, {r['generated']:,} tokens, "
                        f"utilization {r['util']:.3f}; {r['extra']}\n"
                        f"    emulator: {r['timeline']}",
                        flush=True,
                    )
        finally:
            flush_redis()
    report(args, results)


def report(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    by_mode: dict[str, list[float]] = {}
    for r in results:
        by_mode.setdefault(r["mode"], []).append(r["util"])
    ideal = sum(by_mode["ideal"]) / len(by_mode["ideal"]) if "ideal" in by_mode else None
    rows = [
        [
            r["mode"],
            r["span_s"],
            r["generated"],
            r["tok_s"],
            r["capacity"],
            r["util"],
            r["occupancy"],
            r["util"] / ideal if ideal else "-",
        ]
        for r in results
    ]
    print()
    headers = ["mode", "busy span s", "generated tok", "tok/s", "capacity tok/s"]
    headers += ["utilization", "slot occupancy", "util / ideal"]
    print(table(headers, rows))
    tokens = {r["generated"] for r in results}
    if len(tokens) > 1:
        print(f"!! generated token totals differ between runs: {sorted(tokens)}")
    if ideal is None:
        return
    note = " (ideal: mean of its runs)" if len(by_mode["ideal"]) > 1 else ""
    for mode, utils in by_mode.items():
        if mode == "ideal":
            continue
        ratio = sum(utils) / len(utils) / ideal
        target = ""
        if mode == "tokenmill":
            target = " — meets the 0.95 target" if ratio >= 0.95 else " — MISSES the 0.95 target"
        print(f"{mode} / ideal = {ratio:.3f}{target}{note}")


if __name__ == "__main__":
    main()
