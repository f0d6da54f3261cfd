"""The emulator's prefix cache: SGLang's cached_tokens semantics, the radix tree, LRU eviction,
and when the scheduler inserts a prompt (its prefill done, not at admission)."""

from __future__ import annotations

import asyncio

import pytest

from emulator.config import EmulatorConfig
from emulator.model import generate_output
from emulator.prefix_cache import RadixCache
from emulator.protocol import ItemRequest
from emulator.scheduler import Job, Scheduler, new_job


def test_a_repeated_prompt_is_cached_but_its_last_token() -> None:
    cache = RadixCache()
    prompt = list(range(1000, 1100))
    assert cache.match(prompt) == 0
    cache.insert(prompt)
    assert cache.match(prompt) == 99
    assert cache.match([*prompt, 7, 8, 9]) == 100
    assert cache.match([5, *prompt]) == 0
    assert cache.match(prompt[:1]) == 0


def test_a_shared_prefix_is_matched_token_by_token() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5, 6])
    assert cache.match([1, 2, 3, 9, 9]) == 3
    cache.insert([1, 2, 3, 7, 8])  # splits the edge after 3
    assert cache.tokens == 8
    assert cache.match([1, 2, 3, 7, 8, 0]) == 5
    assert cache.match([1, 2, 3, 4, 5, 6, 0]) == 6
    assert cache.match([1, 2, 0]) == 2


def test_inserting_a_cached_sequence_again_adds_nothing() -> None:
    cache = RadixCache()
    cache.insert(list(range(50)))
    cache.insert(list(range(50)))
    cache.insert(list(range(20)))
    assert cache.tokens == 50


def test_the_least_recently_used_leaf_is_evicted_first() -> None:
    cache = RadixCache(max_tokens=30)
    old, used, new = [1] * 10, [2] * 10, [3] * 10
    cache.insert(old)
    cache.insert(used)
    cache.insert(new)
    assert cache.match([*used, 0]) == 10  # used again: now newer than `old`
    cache.insert([4] * 10)
    assert cache.tokens == 30
    assert cache.evicted_tokens == 10
    assert cache.match([*old, 0]) == 0
    assert cache.match([*used, 0]) == 10
    assert cache.match([*new, 0]) == 10


def test_eviction_takes_leaves_before_the_prefix_they_share() -> None:
    cache = RadixCache(max_tokens=25)
    shared = list(range(100, 110))
    cache.insert(shared + [1] * 10)
    cache.insert(shared + [2] * 10)  # 30 tokens: the older branch goes, the shared part stays
    assert cache.tokens == 20
    assert cache.match(shared + [1] * 10) == 10
    assert cache.match(shared + [2] * 10) == 19


def test_a_zero_sized_cache_caches_nothing() -> None:
    cache = RadixCache(max_tokens=0)
    cache.insert(list(range(10)))
    assert cache.match(list(range(10))) == 0
    assert cache.tokens == 0


def test_clear_forgets_everything() -> None:
    cache = RadixCache()
    cache.insert(list(range(10)))
    cache.clear()
    assert cache.match(list(range(10))) == 0


@pytest.mark.parametrize(("size", "expected"), [(None, 64 * 16384), (0, 0), (500, 500)])
def test_the_cache_size_defaults_to_the_kv_pool(size: int | None, expected: int) -> None:
    cfg = EmulatorConfig(max_running=64, context_length=16384, prefix_cache_tokens=size)
    assert cfg.cache_tokens == expected


def test_a_negative_cache_size_is_refused() -> None:
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        EmulatorConfig(prefix_cache_tokens=-1)


CFG = EmulatorConfig(step_ms=1, prefill_ms_per_1k_tokens=0, median_tokens=3, sigma=0)
SAMPLING = {"max_new_tokens": 8}


def _run_jobs(prompts: list[list[int]], *, together: bool) -> list[Job]:
    """Run prompts through a scheduler: all in one submit (admitted in the same step), or each
    after the previous one finished. Returns the finished jobs."""
    cfg = CFG

    async def main() -> list[Job]:
        scheduler = Scheduler(cfg)
        scheduler.start()
        loop_time = asyncio.get_running_loop().time
        jobs = [
            new_job(
                ItemRequest(rid=f"r{i}", input_ids=p, sampling=SAMPLING),
                cfg,
                loop_time(),
            )
            for i, p in enumerate(prompts)
        ]
        try:
            if together:
                scheduler.submit(jobs)
                await asyncio.gather(*(j.done for j in jobs))
            else:
                for job in jobs:
                    scheduler.submit([job])
                    await job.done
        finally:
            await scheduler.stop()
        return jobs

    return asyncio.run(main())


def test_requests_prefilled_in_one_step_do_not_see_each_others_prompts() -> None:
    history = list(range(300, 700))
    jobs = _run_jobs([[*history, 1], [*history, 2]], together=True)
    assert [j.cached_tokens for j in jobs] == [0, 0]


def test_a_later_request_finds_the_prompt_and_output_of_an_earlier_one() -> None:
    history = list(range(300, 700))
    output, _ = generate_output(history, SAMPLING, CFG)
    assert len(output) > 1
    continued = history + output + [5]
    first, second, third = _run_jobs([history, [*history, 5, 6], continued], together=False)
    assert first.cached_tokens == 0
    assert second.cached_tokens == len(history)
    # the finished request's prompt and output but its last token (cache_finished_req)
    assert third.cached_tokens == len(history) + len(output) - 1
