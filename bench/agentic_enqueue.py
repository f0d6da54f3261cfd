"""Enqueue of agentic rows (tools, tool calls, reasoning, ShareGPT tool turns) into Postgres.

Writes N rows of `emulator.fixtures.agentic_rows` (every case of issue 12, cycled) to JSONL, then
enqueues them with `workers.intake.producer.enqueue(..., publish=None)` into a fresh Postgres
database, once per tokenizer:

  fast            the Kimi-K2.5-shaped fixture (a Rust "fast" tokenizer, templated inline)
  custom code     the custom-code fixture: tiktoken behind a PreTrainedTokenizer, its helper
                  module declaring the tools (not "fast": templated in parallel processes)
  slow parallel   the same folder with pure-Python BPE, templated in one process per core
  slow serial     the same, templated in the producer's own process (template_processes=1)

and prints rows/s for each and the parallel/serial ratio of the slow tokenizer. Then, with no
file reading and no database, the slow tokenizer's templating alone (`apply_each` on the
producer's chunks) in this process and in a warmed-up pool (`Templater`), warm-up apart.

    python bench/agentic_enqueue.py                          # 100,000 rows each
    python bench/agentic_enqueue.py --slow-rows 10000        # fewer for the slow pair
    python bench/agentic_enqueue.py --rows 5000 --only slow  # the slow pair only
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from common import bench_database, engine_for, machine_note, table

MODES = ("fast", "custom code", "slow parallel", "slow serial")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument(
        "--slow-rows",
        type=int,
        default=None,
        help="rows for the slow pair (default --rows; the serial one takes longest)",
    )
    p.add_argument(
        "--only", choices=("all", "slow"), default="all", help="slow: the slow pair only"
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    from app.core.contracts import SamplingParams
    from app.prompts.template_pool import default_processes
    from app.prompts.tokenization import load_tokenizer
    from emulator.fixtures.agentic_rows import agentic_rows
    from emulator.fixtures.kimi import ensure_kimi_tokenizer
    from emulator.fixtures.kimi_custom import ensure_agentic_tokenizer
    from workers.intake.producer import EnqueueOptions, enqueue

    print(machine_note())
    with tempfile.TemporaryDirectory(prefix="tm-agentic-") as tmp:
        work = Path(tmp)
        slow_rows = args.rows if args.slow_rows is None else args.slow_rows
        files = {}
        for count in {args.rows, slow_rows}:
            files[count] = work / f"rows-{count}.jsonl"
            with files[count].open("w", encoding="utf-8") as f:
                for row in agentic_rows(count):
                    f.write(json.dumps(row) + "\n")
        folders = {
            "fast": (ensure_kimi_tokenizer(work), False, None),
            "custom code": (ensure_agentic_tokenizer(work), True, None),
            "slow parallel": (ensure_agentic_tokenizer(work, slow=True), True, None),
            "slow serial": (ensure_agentic_tokenizer(work, slow=True), True, 1),
        }
        modes = MODES if args.only == "all" else MODES[2:]
        results: dict[str, tuple[float, int, int]] = {}
        with bench_database() as url:
            db = engine_for(url)
            for mode in modes:
                folder, trust, processes = folders[mode]
                tokenizer = load_tokenizer(folder, trust_remote_code=trust)
                options = EnqueueOptions(
                    files[slow_rows if mode.startswith("slow") else args.rows],
                    mode.replace(" ", "-"),
                    SamplingParams(max_new_tokens=256),
                    trust_remote_code=trust,
                    template_processes=processes,
                )
                start = time.perf_counter()
                report = enqueue(db, tokenizer, options, publish=None)
                wall = time.perf_counter() - start
                results[mode] = (wall, report.inserted, report.skipped)
                print(f"{mode}: {report.inserted} rows in {wall:.1f} s", flush=True)
            db.dispose()
        bare = (
            bare_templating(folders["slow serial"][0], slow_rows) if "slow serial" in modes else ""
        )
    print()
    print(f"{default_processes()} templating processes for the tokenizers that are not fast")
    print(
        table(
            ("tokenizer", "rows", "skipped", "wall s", "rows/s"),
            [(m, n, s, round(w, 1), round(n / w)) for m, (w, n, s) in results.items()],
        )
    )
    if "slow serial" in results and "slow parallel" in results:
        ratio = results["slow serial"][0] / results["slow parallel"][0]
        print(f"slow tokenizer, enqueue, parallel / serial throughput: {ratio:.2f}x")
        print(bare)


def bare_templating(folder: Path, count: int) -> str:
    """The slow tokenizer's templating alone: serial, then in a warmed-up pool."""
    from app.prompts.chat_path import ChatInputs, parse_tools
    from app.prompts.template_pool import Templater
    from app.prompts.tokenization import load_tokenizer
    from emulator.fixtures.agentic_rows import agentic_rows
    from workers.intake.reading import CHUNK_LINES

    batch = [
        ChatInputs(row["messages"], parse_tools(row.get("tools")), row.get("chat_template_kwargs"))
        for row in agentic_rows(count)
        if "messages" in row
    ]
    chunks = [batch[i : i + CHUNK_LINES] for i in range(0, len(batch), CHUNK_LINES)]
    tokenizer = load_tokenizer(folder, trust_remote_code=True)
    start = time.perf_counter()
    serial = [tokenizer.apply_each(chunk) for chunk in chunks]
    serial_s = time.perf_counter() - start
    with Templater(tokenizer) as templater:
        start = time.perf_counter()
        templater.warm_up()
        warm_s = time.perf_counter() - start
        start = time.perf_counter()
        pooled = [f.result() for f in [templater.submit(chunk) for chunk in chunks]]
        pool_s = time.perf_counter() - start
    assert pooled == serial, "the pool's ids differ from serial templating"
    return (
        f"slow tokenizer, templating alone, {len(batch)} rows: serial {serial_s:.1f} s "
        f"({len(batch) / serial_s:.0f} rows/s), {templater.processes} processes "
        f"{pool_s:.1f} s ({len(batch) / pool_s:.0f} rows/s; warm-up {warm_s:.1f} s before): "
        f"{serial_s / pool_s:.2f}x, same ids"
    )


if __name__ == "__main__":
    main()
