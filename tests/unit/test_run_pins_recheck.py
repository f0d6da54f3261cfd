"""A run a server refused is looked at again now and then: an update-weights that paused and
resumed its server between two of the worker's pause checks still reaches the run pinned to
the new weights, and a server that did not change is not asked for its refusal again."""

from __future__ import annotations

from sqlalchemy import Engine, func, select

from app.core.constants import EVENT_FINGERPRINT_MISMATCH
from app.core.contracts import SamplingParams, ServerFingerprint
from app.ledger import common, run_queries
from tests.support.run_pins import pins_on
from workers.engine.run_pins import REFUSED_RECHECK_S


class _Server:
    def __init__(self) -> None:
        self.weights = "step-100"
        self.reads = 0

    def close(self) -> None:
        return None

    def fingerprint(self) -> ServerFingerprint:
        self.reads += 1
        return ServerFingerprint(model_path="m", weight_version=self.weights, version="0.5.23")


def _mismatches(db: Engine) -> int:
    with db.connect() as conn:
        query = select(func.count()).where(common.events.c.kind == EVENT_FINGERPRINT_MISMATCH)
        return int(conn.execute(query).scalar_one())


def test_a_refused_run_is_served_once_its_server_shows_the_pinned_weights(
    sqlite_engine: Engine,
) -> None:
    spec = run_queries.RunSpec(
        "rl", "/t", "a" * 64, "b" * 64, {}, SamplingParams(seed=1), 1, None, [2],
        weight_version="step-200",
    )  # fmt: skip
    with sqlite_engine.begin() as conn:
        run, _ = run_queries.get_or_create_run(conn, spec)
    server, now = _Server(), [0.0]
    pins = pins_on(sqlite_engine, server, now)
    assert not pins.run_matches_server(run.id)  # step-100 serves no step-200 run
    reads = server.reads
    assert not pins.run_matches_server(run.id)  # refused, not asked again at once
    assert server.reads == reads
    now[0] += REFUSED_RECHECK_S
    assert not pins.run_matches_server(run.id)  # asked again: still step-100, still refused
    assert server.reads == reads + 1 and _mismatches(sqlite_engine) == 1
    server.weights = "step-200"  # updated in place, its pause never seen lifted
    assert not pins.run_matches_server(run.id)  # not yet due
    now[0] += REFUSED_RECHECK_S
    assert pins.run_matches_server(run.id)
    assert not pins.refuses_run(run.id)
