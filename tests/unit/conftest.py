"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine

from app import ledger
from app.core.contracts import SamplingParams


@pytest.fixture
def run(sqlite_engine: Engine) -> ledger.RunInfo:
    """A run on the SQLite ledger (sampling seed 1, EOS <|im_end|>)."""
    spec = ledger.RunSpec(
        "r", "/t", "a" * 64, "b" * 64, {}, SamplingParams(seed=1), 1, None, [163586]
    )
    with sqlite_engine.begin() as conn:
        info, _ = ledger.get_or_create_run(conn, spec)
    return info
