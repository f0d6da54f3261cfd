"""The `emulator` command: flags (each also a TOKENMILL_EMULATOR_* variable) → config → server.

`tokenmill emulator` (via ops.emulator_cmd) and `python -m emulator` both run this command.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from app.core import logs
from app.core.network import is_loopback
from emulator.config import (
    DEFAULT_MODEL_PATH,
    DEFAULT_SGLANG_VERSION,
    DEFAULT_WEIGHT_VERSION,
    KIMI_IM_END_ID,
    KIMI_THINK_END_ID,
    EmulatorConfig,
)
from emulator.tool_calls import TOOL_CALL_FAMILIES

ENV_PREFIX = "TOKENMILL_EMULATOR_"
NONE_WORDS = ("", "none", "null")
F = TypeVar("F", bound=Callable[..., Any])


def _int_or_none(ctx: click.Context, param: click.Parameter, value: Any) -> int | None:
    """An integer, or "none" to switch the feature off."""
    if value is None or isinstance(value, int):
        return value
    if str(value).strip().lower() in NONE_WORDS:
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise click.BadParameter(f"{value!r} is not an integer or 'none'") from exc


def _text_or_none(ctx: click.Context, param: click.Parameter, value: Any) -> str | None:
    if value is None or str(value).strip().lower() in NONE_WORDS:
        return None
    return str(value)


def _option(flag: str, *names: str, **kwargs: Any) -> Callable[[F], F]:
    """A flag that is also the environment variable TOKENMILL_EMULATOR_<FLAG>, shown in --help."""
    env = ENV_PREFIX + flag.lstrip("-").split("/")[0].replace("-", "_").upper()
    kwargs.setdefault("show_default", True)
    return click.option(flag, *names, envvar=env, show_envvar=True, **kwargs)


@click.command("emulator")
@_option(
    "--host",
    default="127.0.0.1",
    help="Address to bind. Beyond loopback (e.g. 0.0.0.0) an --api-key is required.",
)
@_option(
    "--port",
    type=click.IntRange(0, 65535),
    default=30000,
    help="Port to bind; 0 picks a free one. Prints 'listening on http://HOST:PORT'.",
)
@_option(
    "--api-key",
    default=None,
    help="Like SGLang's --api-key: every route except /health*, /ready, /metrics and OPTIONS needs "
    "'Authorization: Bearer KEY' (workers send TOKENMILL_SGLANG_API_KEY).",
)
@_option("--model-path", default=DEFAULT_MODEL_PATH, help="Model path reported by /model_info.")
@_option(
    "--tokenizer",
    default=None,
    callback=_text_or_none,
    metavar="DIR|none",
    help="Tokenizer folder (with its chat template) that /v1/tokenize and /v1/detokenize use. "
    "They render with tokenmill's own chat path, not SGLang's, so `tokenmill parity` against "
    "the emulator checks tokenmill against itself: only a real server is proof.",
)
@_option(
    "--trust-remote-code/--no-trust-remote-code",
    default=False,
    help="Let the --tokenizer folder run its own tokenizer code (custom-code tokenizers).",
)
@_option(
    "--weight-version",
    default=DEFAULT_WEIGHT_VERSION,
    help="weight_version at launch (/model_info, every answer's meta_info; outputs depend on "
    "it). /update_weights_from_disk and /update_weight_version change it in place.",
)
@_option(
    "--reasoning-parser",
    default=None,
    callback=_text_or_none,
    metavar="TEXT|none",
    help="reasoning_parser reported by /model_info and /server_info.",
)
@_option(
    "--version",
    "sglang_version",
    default=DEFAULT_SGLANG_VERSION,
    help="SGLang version reported by /server_info.",
)
@_option(
    "--context-length",
    type=click.IntRange(min=2),
    default=16384,
    help="Context length: longer requests get SGLang's 400.",
)
@_option(
    "--refuse-over",
    type=click.IntRange(min=2),
    default=None,
    help="A misconfigured server: /server_info still reports --context-length, but requests "
    "are refused with SGLang's 400 as if the context length were this.",
)
@_option(
    "--median-tokens",
    type=click.FloatRange(min=0, min_open=True),
    default=256.0,
    help="Median output length (tokens before EOS) of the log-normal draw.",
)
@_option(
    "--sigma",
    type=click.FloatRange(min=0),
    default=1.0,
    help="Log-normal sigma of output lengths (heavier tail when larger).",
)
@_option(
    "--token-min",
    type=click.IntRange(min=0),
    default=300,
    help="Smallest ordinary output token id.",
)
@_option(
    "--token-max",
    type=click.IntRange(min=1),
    default=1500,
    help="Ordinary output token ids are below this.",
)
@_option("--eos-id", type=int, default=KIMI_IM_END_ID, help="Id that ends a stopped output.")
@_option(
    "--tool-calls",
    type=click.Choice(list(TOOL_CALL_FAMILIES)),
    default=None,
    help="Stopped outputs of prompts that declare tools end with calls in this family's "
    "format (one call, two parallel, a malformed one, or none, drawn per prompt); needs "
    "--tokenizer.",
)
@_option(
    "--think-end-id",
    default=str(KIMI_THINK_END_ID),
    callback=_int_or_none,
    metavar="INTEGER|none",
    help="Id between reasoning and answer ('none': no reasoning part).",
)
@_option(
    "--max-running",
    type=click.IntRange(min=1),
    default=64,
    help="Batch slots (SGLang --max-running-requests).",
)
@_option(
    "--max-total-tokens",
    type=click.IntRange(min=1),
    default=None,
    show_default="max running x context length",
    help="The KV pool in tokens (SGLang --max-total-tokens): a request waits until its prompt "
    "and output fit beside the running ones, so long requests queue before --max-running "
    "binds.",
)
@_option(
    "--chunked-prefill-size",
    type=click.IntRange(min=1),
    default=8192,
    help="SGLang --chunked-prefill-size, as /server_info reports it.",
)
@_option(
    "--step-ms",
    type=click.FloatRange(min=0),
    default=5.0,
    help="Decode step: every running request gains a token per step. 0 answers at once.",
)
@_option(
    "--prefill-ms-per-1k-tokens",
    type=click.FloatRange(min=0),
    default=2.0,
    help="Prefill time added to the step that admits a request.",
)
@_option(
    "--prefix-cache-tokens",
    type=click.IntRange(min=0),
    default=None,
    show_default="the KV pool: max running x context length",
    help="Tokens the prefix (radix) cache holds, least recently used evicted first; cached "
    "prompt tokens skip prefill and are reported as meta_info.cached_tokens; 0 turns the "
    "cache off.",
)
@_option(
    "--startup-delay-s",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Seconds before the port is bound (weight loading: connection refused).",
)
@_option(
    "--loading-s",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Seconds after binding when health routes and /generate answer 503 (warmup).",
)
@_option(
    "--hang-after-s",
    type=click.FloatRange(min=0),
    default=None,
    help="Seconds after ready when the scheduler freezes for good (/health stays 200).",
)
@_option(
    "--hang-after-requests",
    type=click.IntRange(min=1),
    default=None,
    help="The scheduler freezes for good when this many /generate requests have arrived.",
)
@_option(
    "--health-timeout-s",
    type=click.FloatRange(min=0, min_open=True),
    default=20.0,
    help="How long /health_generate waits for scheduler progress before 503.",
)
@_option(
    "--health-endpoint-generation/--no-health-endpoint-generation",
    default=False,
    help="Make /health probe generation like /health_generate (SGLang's default).",
)
@_option(
    "--error-rate",
    type=click.FloatRange(0, 1),
    default=0.0,
    help="Fraction of /generate answered 500 with a plain-text body.",
)
@_option(
    "--drop-rate",
    type=click.FloatRange(0, 1),
    default=0.0,
    help="Fraction of /generate whose connection is closed without a response.",
)
@_option(
    "--max-queued",
    type=click.IntRange(min=0),
    default=None,
    help="Waiting-queue length at which /generate gets 503 'The request queue is full.'.",
)
@_option("--fault-seed", type=int, default=0, help="Seed of the error/drop draws.")
@_option(
    "--speculative-algorithm",
    default=None,
    callback=_text_or_none,
    metavar="EAGLE|EAGLE3|NEXTN|none",
    help="Speculative decoding as SGLang's flag: finished answers carry meta_info spec_* stats.",
)
@_option(
    "--speculative-draft-model-path",
    default=None,
    callback=_text_or_none,
    help="The draft: its path changes how often drafts are accepted, per kind of prompt.",
)
@_option(
    "--speculative-num-steps",
    type=click.IntRange(min=1),
    default=None,
    help="Draft depth; without it SGLang chooses steps, topk and draft tokens (3, 1, 4).",
)
@_option(
    "--speculative-eagle-topk",
    type=click.IntRange(min=1),
    default=None,
    help="Draft branching (needs --speculative-num-steps).",
)
@_option(
    "--speculative-num-draft-tokens",
    type=click.IntRange(min=2),
    default=None,
    help="Tokens verified per step (needs --speculative-num-steps; num_steps + 1 with topk 1).",
)
@_option(
    "--spec-accept",
    type=click.FloatRange(0, 1, max_open=True),
    default=0.7,
    help="The draft's base chance of accepting each draft token; prompts with more repeated "
    "tokens accept more, and the draft path moves it per kind of prompt.",
)
@_option(
    "--weight-load-s",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Seconds an in-place /update_weights_from_disk takes to load (requests wait).",
)
@_option(
    "--request-log",
    default=None,
    callback=_text_or_none,
    metavar="FILE|none",
    help="Append one JSON line per finished request: rid, received_at, input_ids, output_ids, "
    "counts, the acceptance it drew.",
)
@_option(
    "--prompt-log",
    default=None,
    callback=_text_or_none,
    metavar="FILE|none",
    help="Append one JSON line per /generate prompt received: rid, input_ids, "
    "sampling_params as sent, weight_version.",
)
@_option(
    "--mm",
    default=None,
    callback=_text_or_none,
    type=click.Choice(["kimi", "qwen", "none"], case_sensitive=False),
    help="Serve images on /generate as SGLang's processor of this family: Kimi-K2.5's NaViT "
    "count, or Qwen2.5-VL's smart resize (needs --tokenizer). 'none': a text-only model "
    "that ignores image_data.",
)
@_option(
    "--mm-process-config",
    default=None,
    callback=_text_or_none,
    metavar="JSON|none",
    help="SGLang's --mm-process-config, reported by /server_info; its image keys change the "
    'counts: kimi {"image": {"in_patch_limit": N, "patch_limit_on_one_side": M}}, qwen '
    '{"image": {"min_pixels": A, "max_pixels": B}}.',
)
@_option(
    "--mm-retokenize/--no-mm-retokenize",
    default=False,
    help="Qwen: serve the decoded prompt re-tokenized with the images expanded "
    "(SGLANG_MM_AVOID_RETOKENIZE off), which can change the prompt's ids (token drift).",
)
@_option(
    "--vision-ms-per-1k-tokens",
    type=click.FloatRange(min=0),
    default=4.0,
    help="Vision-encoder time added to the prefill, per 1,000 image tokens not cached.",
)
@_option(
    "--enable-priority-scheduling",
    is_flag=True,
    default=False,
    help="Admit waiting requests by their `priority` (SGLang's flag; higher first), first "
    "come first served within one priority; /server_info says so.",
)
@_option(
    "--schedule-low-priority-values-first",
    is_flag=True,
    default=False,
    help="With --enable-priority-scheduling: lower priority values first (SGLang's flag).",
)
@_option(
    "--log-level",
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    default="INFO",
    help="Log level (logs go to stderr).",
)
def emulator(sglang_version: str, log_level: str, **flags: Any) -> None:
    """Run an SGLang-compatible emulator (native /generate API, batching timing, faults).

    Its /v1/tokenize renders chat requests with tokenmill's own code (app.prompts), not with
    SGLang's chat path: parity and --render-with against it agree with tokenmill by
    construction.

    Blocks until SIGINT/SIGTERM; on SIGTERM, as SGLang, health turns 503 while /generate
    still serves, and it exits 0 once no request is left.
    """
    try:
        cfg = EmulatorConfig(version=sglang_version, **flags)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    if not cfg.api_key and not is_loopback(cfg.host):
        raise click.UsageError(
            f"refusing to listen on {cfg.host!r} without an API key: pass --api-key "
            "(or TOKENMILL_EMULATOR_API_KEY), or listen on 127.0.0.1"
        )
    logs.apply(logs.log_config(log_level, "text"))  # tokenmill's one logging configuration
    from emulator.server import run  # aiohttp only once the command really runs

    sys.exit(run(cfg))
