"""Chaos: a server with a 200-token context and prompts of which every tenth does not fit
with its max_new_tokens (100). SGLang answers those with HTTP 400: they fail at once, with the
server's message, after exactly one attempt; the rest are done; nothing is retried."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.conftest import MAX_NEW_TOKENS, Deployment

pytestmark = pytest.mark.chaos

ITEMS = 250
CONTEXT = 200
SGLANG_TEXT = (
    f"Requested token count exceeds the model's maximum context length of {CONTEXT} tokens"
)


def test_prompts_over_the_context_fail_once_with_the_servers_message(
    deployment: Deployment, kimi_tokenizer_dir: Path
) -> None:
    dep = deployment
    # every 10th prompt carries 40 extra words (~140 prompt tokens; + 100 new > 200),
    # while the prompt alone still fits (so the 'exceeds ... completion' message applies)
    dep.enqueue(kimi_tokenizer_dir, ITEMS, long_every=10, long_words=40)
    emu = dep.emulator({"--context-length": str(CONTEXT)})
    dep.worker("wa", "gpu-a", emu.url)
    dep.beat()
    elapsed = dep.wait_finished(120)

    stored = dep.audit({"gpu-a": emu.config})
    too_long = {s.item_key for s in stored if len(s.prompt_ids) + MAX_NEW_TOKENS > CONTEXT}
    assert too_long == {f"p{i}" for i in range(0, ITEMS, 10)}, "the fixture prompts changed"
    assert all(len(s.prompt_ids) < CONTEXT for s in stored)
    failed = [s for s in stored if s.status == "failed"]
    assert {s.item_key for s in failed} == too_long
    for s in failed:
        assert s.attempts == 1, f"{s.item_key}: a 400 was retried ({s.attempts} attempts)"
        assert s.error is not None and SGLANG_TEXT in s.error, s.error
        total = len(s.prompt_ids) + MAX_NEW_TOKENS
        assert f"You requested a total of {total} tokens" in s.error, s.error
    done = [s for s in stored if s.status == "done"]
    assert len(done) == ITEMS - len(too_long)
    assert {s.attempts for s in done} == {1}
    assert "retry in" not in dep.log_tail("wa", lines=100000), "a request was retried"
    dep.summary("context_length", stored, recover_s=0.0)
    print(f"CHAOS context_length detail: run_s={elapsed:.1f} example_error={failed[0].error!r}")
