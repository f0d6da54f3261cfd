"""`/v1/loads` as SGLang 0.5.23 builds it, taken from the wheel (`managers/load_snapshot.py`:
`LoadSnapshot.to_dict`): the emulator answers the same keys and the same include errors, and
tokenmill reads the wheel's bodies (app.sglang.capacity.load_of)."""

from __future__ import annotations

import functools
from typing import Any, Optional

import msgspec
import pytest

from app.sglang.capacity import Load, capacity_of, load_of
from emulator.config import EmulatorConfig
from emulator.info import load_snapshot, server_info
from emulator.scheduler import Scheduler
from tests.support.sglang_server import _definitions

LOAD_SNAPSHOT = "sglang/srt/managers/load_snapshot.py"
NAMES = (
    "MemoryMetrics",
    "SpeculativeMetrics",
    "LoRAMetrics",
    "DisaggregationMetrics",
    "QueueMetrics",
    "_SECTION_FIELDS",
    "LoadSnapshot",
    "_CORE_KEYS",
)


@functools.cache
def wheel() -> dict[str, Any]:
    namespace: dict[str, Any] = {"msgspec": msgspec, "Optional": Optional}
    _definitions(LOAD_SNAPSHOT, NAMES, namespace)
    return namespace


def wheel_snapshot(**values: Any) -> Any:
    """A LoadSnapshot of one rank with the sections a plain (non-disaggregated) server has."""
    ns = wheel()
    return ns["LoadSnapshot"](
        memory=ns["MemoryMetrics"](1.0, 2.0, 0.5, values.get("max_total_num_tokens", 0)),
        disaggregation=ns["DisaggregationMetrics"]("null"),
        queues=ns["QueueMetrics"](values.get("num_waiting_reqs", 0), 0, 0, 0, 0),
        **values,
    )


def test_the_emulators_snapshot_has_the_wheels_keys_for_every_include() -> None:
    cfg = EmulatorConfig(max_running=256, max_total_tokens=100_000)
    mine = Scheduler(cfg)
    theirs = wheel_snapshot(max_running_requests=256, max_total_num_tokens=100_000)
    for include in (None, {"core"}, {"all"}, {"queues"}, {"core", "memory"}):
        ours = load_snapshot(cfg, mine, include)
        assert set(ours) == set(theirs.to_dict(include)), include


def test_an_unknown_section_is_refused_with_the_wheels_message() -> None:
    cfg = EmulatorConfig()
    with pytest.raises(ValueError) as theirs:
        wheel_snapshot().to_dict({"bogus"})
    with pytest.raises(ValueError) as ours:
        load_snapshot(cfg, Scheduler(cfg), {"bogus"})
    assert str(ours.value) == str(theirs.value)


def test_tokenmill_reads_the_wheels_bodies() -> None:
    ranks = [
        wheel_snapshot(
            dp_rank=rank,
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            max_running_requests=128,
            max_total_num_tokens=400_000,
            token_usage=usage,
        ).to_dict(None)
        for rank, (running, waiting, usage) in enumerate([(128, 40, 0.97), (90, 0, 0.6)])
    ]
    assert load_of({"loads": ranks}) == Load(218, 40, 0.97, 256, 800_000)


def test_the_emulators_capacity_fields_read_as_its_flags() -> None:
    cfg = EmulatorConfig(max_running=512, max_total_tokens=131_072)
    cap = capacity_of(server_info(cfg, 30000, 0.0))
    assert cap is not None
    assert (cap.max_running, cap.max_total_tokens, cap.dp_size) == (512, 131_072, 1)
    assert cap.chunked_prefill == cfg.chunked_prefill_size and cap.source == "internal_states"
