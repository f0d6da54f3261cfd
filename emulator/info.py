"""The emulator's information bodies: /model_info, /server_info, /v1/models and /emulator/stats.

Field names follow SGLang 0.5.23; the stats body is the emulator's own (namespaced route).
"""

from __future__ import annotations

import shlex
from typing import Any

from emulator.config import EmulatorConfig
from emulator.scheduler import Counters, Scheduler
from emulator.weights import Weights


def model_info(cfg: EmulatorConfig, weights: Weights | None = None) -> dict[str, Any]:
    """The model as served now: a weight update moves model_path, served_model_name,
    load_format and weight_version (the tokenizer path stays the launch one)."""
    live = weights or Weights(cfg.model_path, cfg.weight_version)
    model_type, architectures = cfg.model_identity
    return {
        "model_path": live.model_path,
        "served_model_name": live.model_path,
        "tokenizer_path": cfg.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": live.weight_version,
        "load_format": live.load_format,
        "reasoning_parser": cfg.reasoning_parser,
        "tool_call_parser": None,
        "disaggregation_mode": "null",
        "has_image_understanding": cfg.mm is not None,
        "has_audio_understanding": False,
        "model_type": model_type,
        "architectures": list(architectures),
    }


def launch_command(cfg: EmulatorConfig, port: int | None) -> str:
    parts = ["python3", "-m", "sglang.launch_server", "--model-path", cfg.model_path]
    parts += ["--host", cfg.host, "--port", str(cfg.port if port is None else port)]
    parts += ["--context-length", str(cfg.context_length)]
    parts += ["--max-running-requests", str(cfg.max_running)]
    if cfg.reasoning_parser:
        parts += ["--reasoning-parser", cfg.reasoning_parser]
    if cfg.max_queued is not None:
        parts += ["--max-queued-requests", str(cfg.max_queued)]
    if cfg.mm_process_config is not None:
        parts += ["--mm-process-config", cfg.mm_process_config]
    spec = cfg.speculative
    if spec is not None:
        for key, value in spec.server_args().items():
            parts += ["--" + key.replace("_", "-"), str(value)]
    return shlex.join(parts)


def server_info(cfg: EmulatorConfig, port: int | None, startup_time: float) -> dict[str, Any]:
    """Server args, scheduler facts, `internal_states` (one per DP rank) and `version`."""
    args = cfg.server_args(port)
    max_total_num_tokens = cfg.max_total_tokens
    internal_state = {
        **args,
        "world_size": 1,
        "startup_time": startup_time,
        "effective_max_running_requests_per_dp": cfg.max_running,
        "last_gen_throughput": 0.0,
        "memory_usage": {"weight": 0.0, "kvcache": 0.0, "token_capacity": max_total_num_tokens},
    }
    return {
        **args,
        "launch_command": launch_command(cfg, port),
        "max_total_num_tokens": max_total_num_tokens,
        "max_req_input_len": cfg.context_length - 6,
        "startup_time": startup_time,
        "internal_states": [internal_state],
        "version": cfg.version,
        "frontend": "python",
    }


def models_list(cfg: EmulatorConfig, created: int) -> dict[str, Any]:
    card = {
        "id": cfg.served_model_name,
        "object": "model",
        "created": created,
        "owned_by": "sglang",
        "root": cfg.served_model_name,
        "parent": None,
        "max_model_len": cfg.context_length,
    }
    return {"object": "list", "data": [card]}


def stats_json(
    cfg: EmulatorConfig, counters: Counters, scheduler: Scheduler, uptime_s: float, phase: str
) -> dict[str, Any]:
    """Counters for benchmarks: utilization = generated_tokens / (capacity * elapsed)."""
    return {
        **counters.to_json(),
        "capacity_tokens_per_s": cfg.capacity_tokens_per_s,
        "uptime_s": uptime_s,
        "running": scheduler.running,
        "waiting": scheduler.waiting,
        "max_running": cfg.max_running,
        "step_ms": cfg.step_ms,
        "phase": phase,
        "paused": scheduler.paused,
        "hung": scheduler.hung,
    }
