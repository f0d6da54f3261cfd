"""SGLang's own priority: a request carries its run's priority only to a server whose
/server_info says it schedules by priority, in the direction it says; the emulator's waiting
queue admits by it as SGLang's does (higher first, first come first served within one)."""

from __future__ import annotations

import asyncio
from typing import Any

from app.sglang.client import SGLangClient
from emulator.config import EmulatorConfig
from emulator.protocol import ItemRequest
from emulator.scheduler import Scheduler, new_job
from workers.engine.scheduling import ServerPriority


def test_no_priority_is_sent_to_a_server_that_does_not_schedule_by_it() -> None:
    assert ServerPriority(lambda: {"max_running_requests": 16}).request_priority(10) is None
    off = {"enable_priority_scheduling": False}
    assert ServerPriority(lambda: off).request_priority(10) is None
    body = SGLangClient.build_generate_body([1, 2], {"max_new_tokens": 4}, "r1")
    assert "priority" not in body


def test_the_priority_goes_in_the_servers_direction() -> None:
    higher_first = ServerPriority(lambda: {"enable_priority_scheduling": True})
    assert higher_first.request_priority(10) == 10
    lower_first = ServerPriority(
        lambda: {"enable_priority_scheduling": True, "schedule_low_priority_values_first": True}
    )
    assert lower_first.request_priority(10) == -10
    body = SGLangClient.build_generate_body([1, 2], {}, "r1", priority=-10)
    assert body["priority"] == -10


def test_the_server_is_read_once_and_again_after_forget() -> None:
    reads: list[int] = []

    def read() -> dict[str, Any]:
        reads.append(1)
        return {"enable_priority_scheduling": True}

    server = ServerPriority(read)
    server.request_priority(1)
    server.request_priority(2)
    assert len(reads) == 1
    server.forget()
    server.request_priority(3)
    assert len(reads) == 2


def test_an_unreadable_server_gets_no_priority_and_is_asked_again_later() -> None:
    now = [0.0]

    def read() -> dict[str, Any]:
        raise OSError("refused")

    server = ServerPriority(read, clock=lambda: now[0])
    assert server.request_priority(5) is None


def admitted_order(cfg: EmulatorConfig, priorities: list[int | None]) -> list[str]:
    async def run() -> list[str]:
        scheduler = Scheduler(cfg)
        jobs = [
            new_job(ItemRequest(f"r{i}", [1, 2, 3], {"max_new_tokens": 2}, priority=p), cfg, 0.0)
            for i, p in enumerate(priorities)
        ]
        scheduler.submit(jobs)
        return [job.item.rid for job in scheduler._waiting]

    return asyncio.run(run())


def test_the_emulator_admits_by_priority_only_when_enabled() -> None:
    order = [None, 5, 0, 5, -1]
    assert admitted_order(EmulatorConfig(), order) == ["r0", "r1", "r2", "r3", "r4"]
    enabled = EmulatorConfig(enable_priority_scheduling=True)
    assert admitted_order(enabled, order) == ["r1", "r3", "r0", "r2", "r4"]
    low_first = EmulatorConfig(
        enable_priority_scheduling=True, schedule_low_priority_values_first=True
    )
    assert admitted_order(low_first, order) == ["r4", "r0", "r2", "r1", "r3"]
    assert enabled.server_args()["enable_priority_scheduling"] is True
