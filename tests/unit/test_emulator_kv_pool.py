"""The emulator's KV pool (`--max-total-tokens`): a request is admitted only while its prompt and
planned output fit beside the running ones, so long requests queue before max_running binds;
/v1/loads then shows them waiting with slots free."""

from __future__ import annotations

import asyncio
import time

from emulator.config import EmulatorConfig
from emulator.info import load_snapshot
from emulator.protocol import ItemRequest
from emulator.scheduler import Scheduler, kv_tokens, new_job


def admitted(cfg: EmulatorConfig, prompts: int) -> tuple[int, int, list[int], dict[str, object]]:
    """(running, waiting, each job's KV tokens, the load) right after the first admission."""

    async def main() -> tuple[int, int, list[int], dict[str, object]]:
        scheduler = Scheduler(cfg)
        jobs = [
            new_job(
                ItemRequest(f"r{i}", list(range(100 + i, 400 + i)), {"max_new_tokens": 200}),
                cfg,
                time.perf_counter(),
            )
            for i in range(prompts)
        ]
        scheduler.submit(jobs)
        scheduler.start()
        await asyncio.sleep(0.05)  # the first step (10 s long) admitted what fits
        load = load_snapshot(cfg, scheduler, None)
        running, waiting = scheduler.running, scheduler.waiting
        await scheduler.stop()
        return running, waiting, [kv_tokens(j) for j in jobs], load

    return asyncio.run(main())


def test_the_kv_pool_binds_before_max_running() -> None:
    cfg = EmulatorConfig(max_running=64, max_total_tokens=4000, step_ms=10_000)
    running, waiting, sizes, load = admitted(cfg, 40)
    fits = next(n for n in range(len(sizes) + 1) if sum(sizes[: n + 1]) > 4000 or n == len(sizes))
    assert 0 < running == fits < cfg.max_running
    assert waiting == 40 - fits
    assert load["num_running_reqs"] == running and load["num_waiting_reqs"] == waiting
    assert load["max_total_num_tokens"] == 4000
    assert 0 < float(load["token_usage"]) <= 1  # type: ignore[arg-type]


def test_without_a_pool_max_running_binds() -> None:
    cfg = EmulatorConfig(max_running=16, step_ms=10_000)
    running, waiting, _, _ = admitted(cfg, 40)
    assert (running, waiting) == (16, 24)
