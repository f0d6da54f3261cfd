"""The limits a run pins with the fingerprint: read from /server_info, never compared as equal
or not, and a server whose limits no longer admit the run's largest request refuses the run
(its items are left to the others) and says why; a limit that grows is no drift."""

from __future__ import annotations

from sqlalchemy import Engine, select

from app.core.constants import EVENT_FINGERPRINT_MISMATCH
from app.core.contracts import SamplingParams, ServerFingerprint
from app.ledger import common, queue, run_needs, run_queries
from app.sglang import limits
from app.sglang.limits import RequestNeed
from tests.support.run_pins import pins_on
from workers.engine.run_pins import REFUSED_RECHECK_S

INFO = {"context_length": 8192, "max_req_input_len": 8186, "max_total_num_tokens": 524288}


def test_the_limits_are_read_from_server_info() -> None:
    assert limits.limits_of(INFO) == INFO
    assert limits.limits_of({"max_model_len": 4096, "max_req_input_len": True}) == {
        "context_length": 4096
    }
    assert limits.limits_of({"version": "0.5.23"}) is None


def test_a_request_is_refused_as_sglang_refuses_it() -> None:
    fits = RequestNeed(2000, 100)
    assert limits.refusal(INFO, fits) is None
    assert limits.refusal(None, fits) is None  # a server that says nothing is not judged
    small = {**INFO, "context_length": 1024, "max_req_input_len": 1018}
    said = "context_length 1024 < 2100 tokens (2000 of prompt + 100 new)"
    assert limits.refusal(small, fits) == said
    assert limits.refusal({"context_length": 2100}, fits) is None  # input + new == context
    assert limits.refusal({"context_length": 2000}, RequestNeed(2000, 0)) is not None
    assert limits.refusal({"max_req_input_len": 1999}, fits) is not None
    assert limits.refusal({"max_total_num_tokens": 2099}, fits) is not None
    assert limits.largest_input(INFO, 100) == 8092
    assert limits.largest_input({"context_length": 8192, "max_req_input_len": 8000}, 10) == 8000
    assert limits.largest_input({"context_length": 100}, 0) == 99  # the input must stay below
    assert limits.largest_input(None, 100) is None
    assert limits.limit_changes(INFO, small) == [
        "context_length: 8192 → 1024",
        "max_req_input_len: 8186 → 1018",
    ]


def test_limits_are_pinned_but_never_a_difference() -> None:
    pinned = ServerFingerprint(model_path="m", version="0.5.23", limits=INFO)
    smaller = ServerFingerprint(model_path="m", version="0.5.23", limits={"context_length": 1})
    assert pinned.to_json()["limits"] == INFO
    assert "limits" not in ServerFingerprint(model_path="m").to_json()  # the old form
    assert pinned.differences(smaller) == []
    assert ServerFingerprint(**pinned.to_json()) == pinned


class _Server:
    def __init__(self) -> None:
        self.context = 8192

    def close(self) -> None:
        return None

    def fingerprint(self) -> ServerFingerprint:
        return ServerFingerprint(
            model_path="m", version="0.5.23", limits={"context_length": self.context}
        )


def test_a_server_whose_limits_no_longer_admit_the_run_is_drifted_for_it(
    sqlite_engine: Engine,
) -> None:
    spec = run_queries.RunSpec(
        "r1", "/t", "a" * 64, "b" * 64, {}, SamplingParams(seed=1, max_new_tokens=100), 1,
        None, [2],
    )  # fmt: skip
    with sqlite_engine.begin() as conn:
        run, _ = run_queries.get_or_create_run(conn, spec)
        queue.insert_items(
            conn, run.id, [queue.NewItem(f"k{n}", 0, n, None, [1] * n) for n in (10, 2000)]
        )
        assert run_needs.largest_request(conn, run.id, 100) == RequestNeed(2000, 100)
        # an item past the limits the run pinned is its own failure, not the run's need
        small = {"context_length": 1024}
        assert run_needs.largest_request(conn, run.id, 100, small) == RequestNeed(10, 100)
    server, now = _Server(), [0.0]
    assert pins_on(sqlite_engine, server, now).run_matches_server(run.id)  # pins 8192
    server.context = 1024  # restarted with --context-length 1024
    pins = pins_on(sqlite_engine, server, now)
    assert not pins.run_matches_server(run.id)
    with sqlite_engine.connect() as conn:
        (said,) = conn.execute(
            select(common.events.c.message).where(
                common.events.c.kind == EVENT_FINGERPRINT_MISMATCH
            )
        ).scalars()
    assert said == (
        "server gpu-a does not serve run r1: its limits do not admit the run's largest "
        "request: context_length 1024 < 2100 tokens (2000 of prompt + 100 new) (since the run "
        "pinned its limits: context_length: 8192 → 1024)"
    )
    server.context = 16384  # restarted right, and larger: no drift
    now[0] += REFUSED_RECHECK_S
    assert pins.run_matches_server(run.id)
    assert pins.pinned_limits(run.id) == {"context_length": 8192}
