"""`--refuse-over N`: a misconfigured emulator whose /server_info reports its --context-length
while its length checks use N, with SGLang's own 400 text."""

from __future__ import annotations

import pytest

from app.sglang.rules import InvalidRequest, validate_item
from emulator.config import EmulatorConfig
from emulator.info import server_info


def test_a_server_that_reports_8192_but_refuses_past_1024() -> None:
    cfg = EmulatorConfig(context_length=8192, refuse_over=1024)
    assert server_info(cfg, 30000, 0.0)["context_length"] == 8192
    validate_item([1] * 900, {"max_new_tokens": 100}, cfg.checked_context, cfg.vocab_size)
    with pytest.raises(InvalidRequest, match=r"context length \(1024 tokens\)"):
        validate_item([1] * 2000, {"max_new_tokens": 100}, cfg.checked_context, cfg.vocab_size)
    assert EmulatorConfig(context_length=8192).checked_context == 8192
    with pytest.raises(ValueError, match="refuse_over"):
        EmulatorConfig(refuse_over=1)


def test_a_request_past_n_with_its_new_tokens_gets_sglangs_total_text() -> None:
    cfg = EmulatorConfig(context_length=8192, refuse_over=1024)
    with pytest.raises(InvalidRequest, match="maximum context length of 1024 tokens"):
        validate_item([1] * 1000, {"max_new_tokens": 100}, cfg.checked_context, cfg.vocab_size)
