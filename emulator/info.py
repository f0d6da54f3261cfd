"""The emulator's information bodies: /model_info, /server_info, /v1/loads, /v1/models and
/emulator/stats.

Field names follow SGLang 0.5.23; the stats body is the emulator's own (namespaced route).
"""

from __future__ import annotations

import shlex
import time
from datetime import UTC, datetime
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
    if cfg.max_total_tokens is not None:
        parts += ["--max-total-tokens", str(cfg.max_total_tokens)]
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
    max_total_num_tokens = cfg.kv_pool
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


LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


def load_snapshot(
    cfg: EmulatorConfig, scheduler: Scheduler, include: set[str] | None
) -> dict[str, Any]:
    """One DP rank's load as SGLang's LoadSnapshot.to_dict(include) gives it (every core key;
    the memory, disaggregation and queues sections it has; no spec or lora); ValueError
    naming the sections that do not exist."""
    if include is not None and not include <= LOAD_SECTIONS:
        raise ValueError(
            f"Invalid include sections: {include - LOAD_SECTIONS}. "
            f"Valid options: {sorted(LOAD_SECTIONS)}"
        )
    used = scheduler.kv_used
    pool = cfg.kv_pool
    waiting_tokens = scheduler.waiting_tokens
    load: dict[str, Any] = {
        "timestamp": time.time(),
        "dp_rank": 0,
        "num_running_reqs": scheduler.running,
        "num_waiting_reqs": scheduler.waiting,
        "num_waiting_uncached_tokens": waiting_tokens,
        "num_used_tokens": used,
        "num_total_tokens": used + waiting_tokens,
        "num_active_tokens": used + waiting_tokens,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": pool,
        "max_running_requests": cfg.max_running,
        "token_usage": round(used / pool, 4) if pool else 0.0,
        "gen_throughput": 0.0,
        "cache_hit_rate": 0.0,
        "utilization": round(scheduler.running / cfg.max_running, 4),
        "total_prefill_uncached_tokens": scheduler.counters.prefill_tokens,
        "total_prefill_busy_us": 0,
        "decode_moments": None,
    }
    if include == {"core"}:
        return load
    sections = {
        "memory": (
            "memory",
            {"weight_gb": 0.0, "kv_cache_gb": 0.0, "graph_gb": 0.0, "token_capacity": pool},
        ),
        "disagg": (
            "disaggregation",
            {
                "mode": "null",
                "prefill_bootstrap_queue_reqs": 0,
                "prefill_inflight_queue_reqs": 0,
                "decode_prealloc_queue_reqs": 0,
                "decode_transfer_queue_reqs": 0,
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            },
        ),
        "queues": (
            "queues",
            {
                "waiting": scheduler.waiting,
                "grammar": 0,
                "paused": 0,
                "retracted": 0,
                "prealloc_ready": 0,
            },
        ),
    }
    every = include is None or "all" in include
    for name, (key, section) in sections.items():
        if every or (include is not None and name in include):
            load[key] = section
    return load


def loads_body(
    cfg: EmulatorConfig, scheduler: Scheduler, include: set[str] | None, dp_rank: int | None
) -> dict[str, Any]:
    """`GET /v1/loads` as 0.5.23 answers it: one rank (the emulator runs dp_size 1)."""
    loads = [] if dp_rank not in (None, 0) else [load_snapshot(cfg, scheduler, include)]
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": cfg.version,
        "accelerator": None,
        "num_accelerators": 1,
        "loads": loads,
    }


def loads_prometheus(loads: list[dict[str, Any]]) -> str:
    """The `?format=prometheus` text: one gauge per numeric field, nested ones prefixed."""
    prefixes = {"speculative": "spec", "disaggregation": "disagg"}
    samples: dict[str, list[tuple[int, float]]] = {}
    for load in loads:
        rank = load["dp_rank"]
        for key, value in load.items():
            if key == "dp_rank":
                continue
            if isinstance(value, dict):
                prefix = prefixes.get(key, key)
                for sub, sub_value in value.items():
                    if isinstance(sub_value, int | float) and not isinstance(sub_value, bool):
                        samples.setdefault(f"sglang_{prefix}_{sub}", []).append((rank, sub_value))
            elif isinstance(value, int | float) and not isinstance(value, bool):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines += [f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in values]
    return "\n".join(lines) + "\n"
