"""What a `systemctl stop/restart` (SIGTERM) of one server costs a `tokenmill run`: two emulated
servers, SIGTERM one once it has answered some requests; how long its drain takes until it
exits, how many requests it was sent after the signal, and what the run finished with.

    python bench/restart_drain.py --prompts 400 --inflight 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from emulator.fixtures.kimi import ensure_kimi_tokenizer
from ops.emulator_proc import start_emulator

ROOT = Path(__file__).resolve().parents[1]


def stats(url: str) -> dict[str, int] | None:
    try:
        return dict(httpx.get(f"{url}/emulator/stats", timeout=2).json())
    except httpx.HTTPError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--inflight", type=int, default=16, help="TOKENMILL_INFLIGHT")
    parser.add_argument("--step-ms", default="40")
    parser.add_argument("--median-tokens", default="30")
    parser.add_argument("--after", type=int, default=20, help="SIGTERM after this many answers")
    args = parser.parse_args()
    flags = ["--step-ms", args.step_ms, "--median-tokens", args.median_tokens]
    leaving, staying = start_emulator(flags), start_emulator(flags)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        prompts = folder / "p.jsonl"
        prompts.write_text(
            "".join(
                json.dumps({"id": f"q{i}", "prompt": f"hi {i}"}) + "\n" for i in range(args.prompts)
            )
        )
        tokenizer = ensure_kimi_tokenizer(folder)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENMILL_")}
        env |= {
            "TOKENMILL_DATA_DIR": str(folder / "data"),
            "TOKENMILL_INFLIGHT": str(args.inflight),
        }
        argv = [sys.executable, "-m", "ops", "run", str(prompts), "--run", "r", "--tokenizer",
                str(tokenizer), "--server", leaving.url, "--server", staying.url,
                "--max-new-tokens", "64", "--json"]  # fmt: skip
        started = time.monotonic()
        run = subprocess.Popen(
            argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        try:
            while (stats(leaving.url) or {}).get("completed", 0) < args.after:
                time.sleep(0.05)
            at_signal = stats(leaving.url) or {}
            signalled = time.monotonic()
            leaving.popen.terminate()
            last = at_signal
            while leaving.popen.poll() is None:
                last = stats(leaving.url) or last
                time.sleep(0.05)
            exited = time.monotonic()
            out, _ = run.communicate(timeout=1800)
            ended = time.monotonic()
        finally:
            leaving.stop()
            staying.stop()
    counts = json.loads(out)
    out_then = at_signal.get("running", 0) + at_signal.get("waiting", 0)
    sent_after = last.get("requests", 0) - at_signal.get("requests", 0)
    print(f"requests out to it at SIGTERM:        {out_then}")
    print(f"requests it was sent after SIGTERM:   {sent_after}")
    print(f"SIGTERM to exit (its drain):          {exited - signalled:.1f} s")
    print(f"the run went on after it exited for:  {ended - exited:.1f} s")
    done, failed, total = counts["done"], counts["failed"], counts["total"]
    print(f"run: {done} done, {failed} failed of {total} in {ended - started:.1f} s")


if __name__ == "__main__":
    main()
