"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from app.core.contracts import SamplingParams
from app.ledger import run_queries
from workers.engine.window import InflightWindow


@pytest.fixture
def run(sqlite_engine: Engine) -> run_queries.RunInfo:
    """A run on the SQLite ledger (sampling seed 1, EOS <|im_end|>)."""
    spec = run_queries.RunSpec(
        "r", "/t", "a" * 64, "b" * 64, {}, SamplingParams(seed=1), 1, None, [163586]
    )
    with sqlite_engine.begin() as conn:
        info, _ = run_queries.get_or_create_run(conn, spec)
    return info


@pytest.fixture
def started() -> Iterator[list[InflightWindow]]:
    """The windows a test started, stopped when it ends."""
    windows: list[InflightWindow] = []
    yield windows
    for w in windows:
        w.stop(drain_timeout_s=1)
