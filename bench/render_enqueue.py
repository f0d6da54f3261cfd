"""Enqueue with `--render-with` (prompts from an emulator's /v1/tokenize) next to local
templating, in the same run, into a fresh Postgres ledger.

Writes N synthetic chat prompts (bench/common.py's generator) to JSONL, starts one emulator
serving the same fixture tokenizer folder (`--tokenizer DIR`), then enqueues the file into
separate runs, alternating so that load that comes and goes on this shared machine lands on
every side:

  local        `workers.intake.producer.enqueue` with the local chat template (the default path);
  render-wN    the same with `--render-with` the emulator, N /v1/tokenize requests in flight;
  parity       `tokenmill parity` on the render run: every stored prompt re-rendered by the
               emulator and compared (the rate of a full parity check).

Every run's prompts are checked equal to the local run's (same tokenizer on both sides).

    python bench/render_enqueue.py                  # 10,000 prompts, windows 16 and 4
    python bench/render_enqueue.py --prompts 2000 --windows 1 16 64
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    bench_database,
    emulator,
    engine_for,
    fixture_tokenizer_dir,
    machine_note,
    table,
    write_chat_prompts,
)
from meters import proc_cpu_s


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=10_000)
    p.add_argument("--words", type=int, default=200, help="mean words per prompt")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--windows", type=int, nargs="+", default=[16, 4])
    return p.parse_args()


def enqueue_run(db: Any, tokenizer: Any, path: Path, run: str, url: str | None, window: int) -> Any:
    from app.core.contracts import SamplingParams
    from app.sglang.render import RenderClient, RenderPolicy
    from workers.intake.producer import EnqueueOptions, enqueue

    options = EnqueueOptions(
        input_path=path, run=run, sampling=SamplingParams(seed=1), render_with=url
    )
    if url is None:
        return enqueue(db, tokenizer, options, publish=None)
    with RenderClient(
        url, window=window, connect_timeout_s=5, timeout_s=120, policy=RenderPolicy(wait_s=60)
    ) as renderer:
        return enqueue(db, tokenizer, options, publish=None, renderer=renderer)


def prompts_of(db: Any, run: str) -> dict[str, list[int]]:
    from app.ledger import reads, run_queries

    with db.connect() as conn:
        info = run_queries.get_run(conn, run)
        stored = reads.stored_prompts(conn, reads.prompt_item_ids(conn, info.id))
    return {item.item_key: item.prompt_ids for item in stored}


def main() -> None:
    args = parse_args()
    print(f"render-with enqueue benchmark — {machine_note()}")
    from app.ledger import run_queries
    from app.prompts.tokenization import load_tokenizer
    from app.sglang.render import RenderClient, RenderPolicy
    from workers.control.parity import check_run

    folder = fixture_tokenizer_dir()
    tokenizer = load_tokenizer(folder)
    with (
        tempfile.TemporaryDirectory(prefix="tm-bench-render-") as tmp,
        bench_database() as pg_url,
        emulator(["--tokenizer", str(folder)]) as server,
    ):
        path = Path(tmp) / "prompts.jsonl"
        write_chat_prompts(path, args.prompts, words=args.words, seed=args.seed)
        db = engine_for(pg_url)
        plan: list[tuple[str, int]] = [("local", 0)]
        for window in args.windows:
            plan += [(f"render-w{window}", window), ("local", 0)]
        rows: list[list[Any]] = []
        local_runs = 0
        for label, window in plan:
            run = label if label != "local" else f"local-{local_runs}"
            local_runs += label == "local"
            emu_cpu = proc_cpu_s(server.popen.pid)
            t0 = time.perf_counter()
            report = enqueue_run(db, tokenizer, path, run, server.url if window else None, window)
            wall_s = time.perf_counter() - t0
            emu_cpu = proc_cpu_s(server.popen.pid) - emu_cpu
            rows.append([run, wall_s, report.inserted / wall_s, emu_cpu])
            print(f"{run}: {report.inserted} items in {wall_s:.1f} s", flush=True)
        reference = prompts_of(db, "local-0")
        for label, window in plan:
            if window:
                assert prompts_of(db, label) == reference, f"{label} differs from local"
        with db.connect() as conn:
            run_info = run_queries.get_run(conn, f"render-w{args.windows[0]}")
        policy = RenderPolicy(wait_s=60)
        with RenderClient(
            server.url, window=args.windows[0], connect_timeout_s=5, timeout_s=120, policy=policy
        ) as client:
            t0 = time.perf_counter()
            parity = check_run(db, run_info, client, server=server.url)
            wall_s = time.perf_counter() - t0
        assert parity.equal == parity.checked == args.prompts
        rows.append([f"parity (window {args.windows[0]})", wall_s, parity.checked / wall_s, "-"])
        print()
        print(table(["", "wall s", "prompts/s", "emulator CPU s"], rows))
        local = [r[2] for r in rows if str(r[0]).startswith("local")]
        print(
            f"\n{args.prompts} prompts; every rendered run equals the local one. Local "
            f"templating {min(local):,.0f}-{max(local):,.0f} prompts/s."
        )
        db.dispose()


if __name__ == "__main__":
    main()
