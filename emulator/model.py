"""Deterministic generation of the SGLang emulator: the output ids and finish reason of a request.

A pure function of (prompt ids, sampling params, config): the project's tests check outputs by it.
"""

from __future__ import annotations

import hashlib
import math
import random
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from app.sglang.rules import GREEDY_TEMPERATURE
from emulator.config import DEFAULT_MAX_NEW_TOKENS, DEFAULT_WEIGHT_VERSION, EmulatorConfig
from emulator.tool_calls import ToolCallWriter

FinishReason = dict[str, Any]

# Part of every seed: changing how outputs are drawn must change this, so outputs stored by an
# older emulator fail their checks loudly instead of matching by accident.
GENERATION_VERSION = b"tokenmill-emulator/1"
# Where `</think>` falls inside a stopped output, as a share of the tokens before EOS.
REASONING_SHARE_MIN = 0.55
REASONING_SHARE_SPAN = 0.40


def is_greedy(sampling: Mapping[str, Any]) -> bool:
    """Greedy decoding, as SGLang decides it: temperature ~0 or top_k == 1."""
    temperature = sampling.get("temperature")
    if temperature is not None and float(temperature) < GREEDY_TEMPERATURE:
        return True
    return sampling.get("top_k") == 1


def generation_seed(
    input_ids: Sequence[int],
    sampling: Mapping[str, Any],
    sample_index: int = 0,
    weight_version: str = DEFAULT_WEIGHT_VERSION,
) -> int:
    """The seed of one output: prompt ids, plus sampling_seed and temperature unless greedy,
    and the weights (their version: other weights answer otherwise, greedy or not)."""
    if is_greedy(sampling):
        key: tuple[Any, ...] = (None, 0.0, 0)
    else:
        temperature = sampling.get("temperature")
        key = (
            sampling.get("sampling_seed"),
            1.0 if temperature is None else float(temperature),
            sample_index,
        )
    digest = hashlib.blake2b(GENERATION_VERSION, digest_size=16)
    digest.update(_ids_bytes(input_ids))
    digest.update(repr(key).encode())
    if weight_version != DEFAULT_WEIGHT_VERSION:
        # the launch default adds nothing, so outputs stored before versions counted still match
        digest.update(b"weights:" + weight_version.encode())
    return int.from_bytes(digest.digest(), "big")


def resolve_max_new_tokens(input_len: int, sampling: Mapping[str, Any], cfg: EmulatorConfig) -> int:
    """max_new_tokens as the server applies it: 128 when absent, the context's rest when null."""
    room = max(cfg.context_length - input_len, 0)
    if "max_new_tokens" not in sampling:
        return min(DEFAULT_MAX_NEW_TOKENS, room)
    value = sampling["max_new_tokens"]
    return room if value is None else int(value)


def draw_content_length(rng: random.Random, cfg: EmulatorConfig) -> int:
    """Tokens before EOS: log-normal around the configured median, at least one."""
    if cfg.sigma == 0:
        return max(1, round(cfg.median_tokens))
    return max(1, round(rng.lognormvariate(math.log(cfg.median_tokens), cfg.sigma)))


def generate_output(
    input_ids: Sequence[int],
    sampling: Mapping[str, Any],
    cfg: EmulatorConfig,
    *,
    sample_index: int = 0,
    weight_version: str | None = None,
    tool_calls: ToolCallWriter | None = None,
) -> tuple[list[int], FinishReason]:
    """The output ids and finish reason the emulator returns for one prompt.

    A stopped output is `reasoning, </think>, answer, EOS` (no `</think>` when the config has
    none) and ends with its EOS; a longer draw is cut at max_new_tokens with finish "length".
    Every position consumes one draw, so a smaller max_new_tokens gives a prefix of the output
    a larger one gives. `ignore_eos` runs on past EOS to max_new_tokens; `stop_token_ids` stop
    at the first listed id the stream contains; `min_new_tokens` holds back EOS and stops.
    The weights are cfg's unless weight_version names the ones loaded since. tool_calls
    (`--tool-calls`): a stopped output of a prompt that declares tools may end in calls.
    """
    max_new_tokens = resolve_max_new_tokens(len(input_ids), sampling, cfg)
    min_new_tokens = int(sampling.get("min_new_tokens") or 0)
    ignore_eos = bool(sampling.get("ignore_eos"))

    version = cfg.weight_version if weight_version is None else weight_version
    rng = random.Random(generation_seed(input_ids, sampling, sample_index, version))
    content_len = max(draw_content_length(rng, cfg), min_new_tokens)
    reasoning_share = REASONING_SHARE_MIN + REASONING_SHARE_SPAN * rng.random()
    think_at = int((content_len - 1) * reasoning_share)

    limit = max_new_tokens if ignore_eos else min(max_new_tokens, content_len + 1)
    low, span, draw = cfg.token_min, cfg.token_max - cfg.token_min, rng.random
    output = [low + int(draw() * span) for _ in range(limit)]
    if cfg.think_end_id is not None and think_at < limit:
        output[think_at] = cfg.think_end_id
    if content_len < limit:
        output[content_len] = cfg.eos_id

    if not ignore_eos:
        stop_ids = sampling.get("stop_token_ids")
        if stop_ids:
            stops = set(stop_ids)
            for position in range(min_new_tokens, len(output)):
                if output[position] in stops:
                    return output[: position + 1], {"type": "stop", "matched": output[position]}
        if content_len < max_new_tokens:
            if tool_calls is not None:
                seed = rng.getrandbits(64)
                output = tool_calls.rewrite(input_ids, output, max_new_tokens, seed)
            return output, {"type": "stop", "matched": cfg.eos_id}
    return output, {"type": "length", "length": max_new_tokens}


def reasoning_token_count(output_ids: Sequence[int], cfg: EmulatorConfig) -> int:
    """Tokens up to and including `</think>` (all of them while it has not come yet)."""
    if cfg.think_end_id is None:
        return 0
    try:
        return list(output_ids).index(cfg.think_end_id) + 1
    except ValueError:
        return len(output_ids)


def render_text(
    output_ids: Sequence[int], cfg: EmulatorConfig, *, skip_special_tokens: bool = True
) -> str:
    """A cheap stand-in for detokenized text: the ids, space-joined (specials dropped if asked)."""
    if skip_special_tokens:
        specials = {cfg.eos_id, cfg.think_end_id}
        return " ".join([str(t) for t in output_ids if t not in specials])
    return " ".join(map(str, output_ids))


def _ids_bytes(input_ids: Sequence[int]) -> bytes:
    try:
        packed = array("q", input_ids)
    except (OverflowError, TypeError):
        return ",".join(map(str, input_ids)).encode()
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()
