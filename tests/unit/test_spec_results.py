"""The client side of speculative decoding: meta_info's spec_* fields parsed into SpecStats (a
malformed one is retried, never stored), and the speculative settings pinned in the fingerprint
so that another draft is a fingerprint change."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.core.contracts import ServerFingerprint, SpecStats
from app.core.errors import RetryableError
from app.sglang.client import speculative_settings
from app.sglang.responses import parse_generate_response

SPEC = {
    "spec_accept_rate": 0.5,
    "spec_accept_length": 2.5,
    "spec_num_correct_drafts": 6,
    "spec_num_proposed_drafts": 12,
    "spec_verify_ct": 4,
    "spec_correct_drafts_histogram": [1, 1, 1, 1],
}


def body(**meta: Any) -> bytes:
    info = {"id": "r1", "finish_reason": {"type": "stop", "matched": 2}, "completion_tokens": 10}
    return json.dumps({"text": "", "output_ids": [1] * 9 + [2], "meta_info": info | meta}).encode()


def parse(content: bytes) -> Any:
    return parse_generate_response(content, "r1", prompt_tokens_sent=3, elapsed_s=0.1)


def test_spec_fields_become_spec_stats() -> None:
    assert parse(body(**SPEC)).spec == SpecStats(4, 6, 12, 2.5, 0.5, (1, 1, 1, 1))
    assert parse(body()).spec is None  # no speculation, or a one-token output


@pytest.mark.parametrize(
    "bad",
    [
        {"spec_correct_drafts_histogram": [1, -1]},
        {"spec_correct_drafts_histogram": "1,2"},
        {"spec_accept_length": "2.5"},
        {"spec_verify_ct": -1},
        {"spec_accept_rate": True},
    ],
)
def test_malformed_spec_fields_are_retried(bad: dict[str, Any]) -> None:
    with pytest.raises(RetryableError, match=r"meta_info\.spec_"):
        parse(body(**(SPEC | bad)))


def server_info(draft: str | None, **extra: Any) -> dict[str, Any]:
    args = {
        "version": "0.5.23",
        "speculative_algorithm": "EAGLE3" if draft else None,
        "speculative_draft_model_path": draft,
        "speculative_num_steps": 3 if draft else None,
        "speculative_eagle_topk": 1 if draft else None,
        "speculative_num_draft_tokens": 4 if draft else None,
    }
    return args | extra


def test_the_fingerprint_pins_the_draft() -> None:
    assert speculative_settings(server_info(None)) is None
    a = ServerFingerprint(model_path="m", speculative=speculative_settings(server_info("/d/a")))
    b = ServerFingerprint(model_path="m", speculative=speculative_settings(server_info("/d/b")))
    assert a.to_json()["speculative"] == {
        "algorithm": "EAGLE3",
        "draft_model_path": "/d/a",
        "num_draft_tokens": 4,
        "num_steps": 3,
        "eagle_topk": 1,
    }
    assert a.differences(b) == [f"speculative: {a.speculative} → {b.speculative}"]
    # a server that stopped speculating differs too; one that never did keeps the old form
    plain = ServerFingerprint(model_path="m")
    assert "speculative" not in plain.to_json()
    assert a.differences(plain) == [f"speculative: {a.speculative} → None"]
    assert ServerFingerprint(**a.to_json()).differences(a) == []
