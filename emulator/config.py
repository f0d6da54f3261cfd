"""Configuration of the SGLang emulator: one frozen value with every flag and its default.

Built by the CLI from flags (each also an environment variable); tests build it directly.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from emulator.speculative import SpecSettings, resolve_settings
from emulator.vision import FAMILY_MODELS, check_process_config

KIMI_IM_END_ID = 163586
KIMI_THINK_END_ID = 163607

DEFAULT_MODEL_PATH = "moonshotai/Kimi-K2.5"
DEFAULT_SGLANG_VERSION = "0.5.23"
# what SGLang applies when a request does not send max_new_tokens
DEFAULT_MAX_NEW_TOKENS = 128
# SGLang's --weight-version default
DEFAULT_WEIGHT_VERSION = "default"


@dataclass(frozen=True)
class EmulatorConfig:
    """Everything one emulated server is: identity, generation, batching timing, faults."""

    # network and identity (what /model_info and /server_info report)
    host: str = "127.0.0.1"
    port: int = 30000
    # SGLang's --api-key: every route but /health*, /ready, /metrics and OPTIONS needs
    # `Authorization: Bearer <key>`; required to listen beyond loopback
    api_key: str | None = None
    model_path: str = DEFAULT_MODEL_PATH
    weight_version: str = DEFAULT_WEIGHT_VERSION
    reasoning_parser: str | None = None
    version: str = DEFAULT_SGLANG_VERSION
    context_length: int = 16384
    # a misconfigured server: the context length its length checks use, while /server_info
    # reports context_length (None: context_length, as SGLang does)
    refuse_over: int | None = None
    vocab_size: int = 163840
    model_type: str = "kimi_k25"
    architectures: tuple[str, ...] = ("KimiK25ForConditionalGeneration",)
    # the tokenizer folder /v1/tokenize and /v1/detokenize use (None: they answer 400);
    # trust_remote_code lets it run the folder's own tokenizer code
    tokenizer: str | None = None
    trust_remote_code: bool = False

    # deterministic generation (see emulator.model)
    median_tokens: float = 256.0
    sigma: float = 1.0
    token_min: int = 300
    token_max: int = 1500
    eos_id: int = KIMI_IM_END_ID
    think_end_id: int | None = KIMI_THINK_END_ID

    # continuous batching (see emulator.scheduler)
    max_running: int = 64
    # the KV pool in tokens (SGLang's max_total_num_tokens); a request is admitted only while
    # the running batch's prompts and planned outputs fit, so long requests queue before
    # max_running binds. None: max_running x context_length (never binds first)
    max_total_tokens: int | None = None
    # SGLang's chunked_prefill_size, as /server_info reports it
    chunked_prefill_size: int = 8192
    step_ms: float = 5.0
    # SGLang's --enable-priority-scheduling: waiting requests are admitted by their `priority`
    # (higher first, or lower first with --schedule-low-priority-values-first), first come
    # first served within one; a request without one counts as 0. Not emulated: preemption
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    prefill_ms_per_1k_tokens: float = 2.0
    # the prefix cache (SGLang's radix cache): tokens it holds before evicting the least
    # recently used; None: the KV pool's size (max_running x context_length), 0: no cache
    prefix_cache_tokens: int | None = None

    # startup, health and faults (see emulator.server)
    startup_delay_s: float = 0.0
    loading_s: float = 0.0
    hang_after_s: float | None = None
    # the scheduler freezes for good when this many /generate requests have arrived (a hang
    # placed by the work done, not the clock: the same on a loaded machine)
    hang_after_requests: int | None = None
    health_timeout_s: float = 20.0
    health_endpoint_generation: bool = False
    error_rate: float = 0.0
    drop_rate: float = 0.0
    max_queued: int | None = None
    fault_seed: int = 0
    # seconds an in-place weight update (/update_weights_from_disk) takes to load
    weight_load_s: float = 0.0
    # a JSONL file that gets one line per /generate prompt received (rid, input_ids,
    # sampling_params, the weight version it ran under): what the server was sent
    prompt_log: str | None = None

    # speculative decoding (see emulator.speculative): SGLang's --speculative-* flags and
    # the draft's base acceptance; off without an algorithm
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    spec_accept: float = 0.7
    # a JSONL file with one line per finished request (None: no log)
    request_log: str | None = None

    # images on /generate (see emulator.vision): the multimodal family ("kimi", "qwen"; None:
    # a text-only model that ignores image_data), SGLang's --mm-process-config as JSON text,
    # Qwen's decode + re-tokenize fallback (SGLANG_MM_AVOID_RETOKENIZE off), and the vision
    # encoder's cost, added to the prefill of the image tokens it computes
    mm: str | None = None
    # `--tool-calls FAMILY` (emulator.tool_calls): stopped outputs of prompts that declare
    # tools end with calls in the family's format (needs tokenizer)
    tool_calls: str | None = None
    mm_process_config: str | None = None
    mm_retokenize: bool = False
    vision_ms_per_1k_tokens: float = 4.0

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise ValueError("invalid emulator configuration: " + "; ".join(problems))

    @property
    def checked_context(self) -> int:
        """The context length each request is checked against (refuse_over, if set)."""
        return self.refuse_over if self.refuse_over is not None else self.context_length

    def _problems(self) -> list[str]:
        checks = [
            (0 <= self.port <= 65535, "port must be in [0, 65535]"),
            (self.context_length >= 2, "context_length must be at least 2"),
            (self.refuse_over is None or self.refuse_over >= 2, "refuse_over must be >= 2"),
            (self.median_tokens > 0 and math.isfinite(self.median_tokens), "median_tokens > 0"),
            (self.sigma >= 0 and math.isfinite(self.sigma), "sigma must be >= 0"),
            (0 <= self.token_min < self.token_max, "need 0 <= token_min < token_max"),
            (self.max_running >= 1, "max_running must be at least 1"),
            (
                self.max_total_tokens is None or self.max_total_tokens >= 1,
                "max_total_tokens must be at least 1",
            ),
            (self.step_ms >= 0, "step_ms must be >= 0"),
            (self.prefill_ms_per_1k_tokens >= 0, "prefill_ms_per_1k_tokens must be >= 0"),
            (
                self.prefix_cache_tokens is None or self.prefix_cache_tokens >= 0,
                "prefix_cache_tokens must be >= 0",
            ),
            (self.startup_delay_s >= 0, "startup_delay_s must be >= 0"),
            (self.loading_s >= 0, "loading_s must be >= 0"),
            (self.hang_after_s is None or self.hang_after_s >= 0, "hang_after_s must be >= 0"),
            (
                self.hang_after_requests is None or self.hang_after_requests >= 1,
                "hang_after_requests must be >= 1",
            ),
            (self.health_timeout_s > 0, "health_timeout_s must be > 0"),
            (0 <= self.error_rate <= 1, "error_rate must be in [0, 1]"),
            (0 <= self.drop_rate <= 1, "drop_rate must be in [0, 1]"),
            (self.error_rate + self.drop_rate <= 1, "error_rate + drop_rate must be <= 1"),
            (self.max_queued is None or self.max_queued >= 0, "max_queued must be >= 0"),
            (self.weight_load_s >= 0, "weight_load_s must be >= 0"),
            (
                self.tool_calls is None or self.tokenizer is not None,
                "tool_calls needs a tokenizer (--tokenizer DIR) to read the prompt's tools",
            ),
        ]
        problems = [message for ok, message in checks if not ok]
        problems += self._image_problems()
        try:
            _ = self.speculative
        except ValueError as exc:
            problems.append(str(exc))
        specials = {self.eos_id, self.think_end_id}
        if any(s is not None and self.token_min <= s < self.token_max for s in specials):
            problems.append("eos_id and think_end_id must lie outside [token_min, token_max)")
        return problems

    def _image_problems(self) -> list[str]:
        problems = []
        if self.mm is not None and self.mm not in FAMILY_MODELS:
            problems.append(
                f"mm must be one of {', '.join(FAMILY_MODELS)} or none, got {self.mm!r}"
            )
        if self.mm_retokenize and self.mm != "qwen":
            problems.append("mm_retokenize is Qwen's fallback: it needs mm 'qwen'")
        if self.mm == "qwen" and self.tokenizer is None:
            problems.append("mm 'qwen' decodes and re-tokenizes prompts: it needs a tokenizer")
        if self.vision_ms_per_1k_tokens < 0:
            problems.append("vision_ms_per_1k_tokens must be >= 0")
        if self.mm_process_config is not None:
            try:
                check_process_config(self.process_config, self.mm)
            except ValueError as exc:
                problems.append(f"mm_process_config: {exc}")
        return problems

    @property
    def process_config(self) -> dict[str, Any]:
        """--mm-process-config parsed (SGLang resolves an absent one to {})."""
        if self.mm_process_config is None:
            return {}
        try:
            value = json.loads(self.mm_process_config)
        except ValueError as exc:
            raise ValueError(f"mm_process_config is not JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError("mm_process_config must be a JSON object")
        return value

    @property
    def model_identity(self) -> tuple[str, tuple[str, ...]]:
        """The model_type and architectures /model_info reports (the --mm family's model)."""
        if self.mm is not None and self.mm in FAMILY_MODELS:
            return FAMILY_MODELS[self.mm]
        return self.model_type, self.architectures

    @property
    def immediate(self) -> bool:
        """step_ms 0: answer at once, without the batching scheduler (overhead benchmarks)."""
        return self.step_ms == 0

    @property
    def capacity_tokens_per_s(self) -> float | None:
        """Decode tokens per second with every slot busy; None when step_ms is 0."""
        if self.immediate:
            return None
        return self.max_running * 1000.0 / self.step_ms

    @property
    def kv_pool(self) -> int:
        """The KV pool in tokens, as /server_info reports it (max_total_num_tokens)."""
        if self.max_total_tokens is not None:
            return self.max_total_tokens
        return self.max_running * self.context_length

    @property
    def cache_tokens(self) -> int:
        """Tokens the prefix cache holds at most."""
        if self.prefix_cache_tokens is None:
            return self.kv_pool
        return self.prefix_cache_tokens

    @property
    def speculative(self) -> SpecSettings | None:
        """The resolved speculative settings (SGLang's rules), None when speculation is off."""
        return resolve_settings(
            self.speculative_algorithm,
            self.speculative_draft_model_path,
            self.speculative_num_steps,
            self.speculative_eagle_topk,
            self.speculative_num_draft_tokens,
            self.spec_accept,
        )

    @property
    def served_model_name(self) -> str:
        return self.model_path

    def server_args(self, port: int | None = None) -> dict[str, Any]:
        """The SGLang-named server arguments /server_info reports (a realistic subset)."""
        args: dict[str, Any] = {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "served_model_name": self.served_model_name,
            "host": self.host,
            "port": self.port if port is None else port,
            "context_length": self.context_length,
            "max_running_requests": self.max_running,
            "max_total_tokens": self.max_total_tokens,
            "chunked_prefill_size": self.chunked_prefill_size,
            "max_queued_requests": self.max_queued,
            "enable_priority_scheduling": self.enable_priority_scheduling,
            "schedule_low_priority_values_first": self.schedule_low_priority_values_first,
            "reasoning_parser": self.reasoning_parser,
            "tool_call_parser": None,
            "weight_version": self.weight_version,
            "skip_tokenizer_init": False,
            "incremental_streaming_output": False,
            "disable_radix_cache": self.prefix_cache_tokens == 0,
            "disaggregation_mode": "null",
            "load_format": "auto",
            "trust_remote_code": True,
            "tp_size": 1,
            "dp_size": 1,
            "watchdog_timeout": 300,
            "enable_metrics": False,
            "speculative_algorithm": None,
            "speculative_draft_model_path": None,
            "speculative_num_steps": None,
            "speculative_eagle_topk": None,
            "speculative_num_draft_tokens": None,
            # app.core.images.IMAGE_SETTINGS, with SGLang's resolved defaults
            "enable_multimodal": True if self.mm else None,
            "mm_process_config": self.process_config,
            "image_processor_backend": "auto",
            "disable_fast_image_processor": False,
            "limit_mm_data_per_request": None,
        }
        spec = self.speculative
        if spec is not None:
            args.update(spec.server_args())
        return args

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("api_key")
        data["architectures"] = list(self.architectures)
        return data
