"""The scheduler process of the harness: the scheduler side of SGLang's IPC protocol, no model.

It takes SGLang's own sockets (`SchedulerIpcChannels.create`) and messages (`io_struct`): the
ready handshake `_launch_subprocesses` waits for, `TokenizedGenerateReqInput` in and
`BatchTokenIDOutput` out to the DetokenizerManager, `AbortReq`, `FlushCacheReqInput`,
pause/continue, `UpdateWeightFromDiskReqInput`, `GetInternalStateReq` and `ShutdownReq`, and it
writes SGLang's load snapshot (`/v1/loads`). Outputs are deterministic: token k of a request is
a function of its prompt ids, its sampling_seed and temperature (unless greedy), k and the
loaded weights; a step takes STEP_S and ends a request with EOS at EOS_RATE per token (unless
ignore_eos), or at max_new_tokens. The queue limit (`--max-queued-requests`) and the input
length check are the real scheduler's.
"""

from __future__ import annotations

import hashlib
import os
import time
from array import array
from typing import Any

STEP_S = float(os.environ.get("HARNESS_STEP_S", "0.005"))
EOS_RATE = float(os.environ.get("HARNESS_EOS_RATE", "0.05"))
LOAD_PUBLISH_S = 0.05
ORDINARY_IDS = int(os.environ.get("HARNESS_ORDINARY_IDS", "2000"))


def _token(seed: bytes, k: int) -> int:
    digest = hashlib.blake2b(seed + k.to_bytes(4, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class _Req:
    def __init__(self, obj: Any, eos_id: int) -> None:
        self.obj = obj
        self.rid = obj.rid
        ids = list(obj.input_ids or [])
        self.prompt_len = len(ids)
        # prompt ids, plus sampling_seed and temperature unless greedy (as the emulator seeds)
        params = obj.sampling_params
        sampled = (
            b""
            if params.temperature == 0
            else repr((params.sampling_seed, params.temperature)).encode()
        )
        self.seed = hashlib.blake2b(array("q", ids).tobytes() + sampled).digest()
        self.max_new = obj.sampling_params.max_new_tokens
        self.max_new = 128 if self.max_new is None else self.max_new
        self.eos_id = eos_id
        self.out: list[int] = []
        self.sent = 0

    def step(self, weight_salt: bytes) -> dict[str, Any] | None:
        """One decode step; the finish reason when this token ends the request."""
        k = len(self.out)
        value = _token(self.seed + weight_salt, k)
        eos = (value % 10_000) < EOS_RATE * 10_000 and k > 0
        if eos and not self.obj.sampling_params.ignore_eos:
            self.out.append(self.eos_id)
            return {"type": "stop", "matched": self.eos_id}
        self.out.append(256 + value % (ORDINARY_IDS - 256))
        if len(self.out) >= self.max_new:
            return {"type": "length", "length": self.max_new}
        return None


def run_fake_scheduler(
    server_args: Any,
    port_args: Any,
    gpu_id: int,
    tp_rank: int,
    pp_rank: int,
    dp_rank: int | None,
    pipe_writer: Any,
    *rest: Any,
    **kwargs: Any,
) -> None:
    """`launch_server`'s run_scheduler_process_func: handshake, then the event loop."""
    import zmq
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.managers import io_struct as io
    from sglang.srt.managers.scheduler_components.ipc_channels import SchedulerIpcChannels
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank

    # the scheduler's runtime context, published as run_scheduler_process does
    ranks = SpawnRanks(
        world_rank=spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=pp_rank),
        dp_rank=dp_rank,
        gpu_id=gpu_id,
    )
    publish(server_args, role="scheduler", ranks=ranks)
    cfg = resolving_view(server_args)
    config = _model_config(cfg.model_path)
    context_len = cfg.context_length or config.get("max_position_embeddings", 4096)
    eos_id = _eos_id(cfg.model_path, config)
    max_running = cfg.max_running_requests or 64
    max_queued = cfg.max_queued_requests
    max_req_input_len = context_len - 1

    channels = SchedulerIpcChannels.create(
        port_args=port_args,
        is_rank_zero=True,
        skip_tokenizer_init=False,
        metrics_enabled=False,
        enable_scripted_runtime=False,
    )
    pipe_writer.send(
        {
            "status": "ready",
            "max_total_num_tokens": max_running * context_len,
            "max_req_input_len": max_req_input_len,
            "startup_time": {},
        }
    )
    loads = _load_writer(port_args)
    published = 0.0
    running: list[_Req] = []
    waiting: list[_Req] = []
    paused = False
    weight_version = cfg.weight_version
    weight_salt = b""
    poller = zmq.Poller()
    poller.register(channels.recv_from_tokenizer, zmq.POLLIN)
    if channels.recv_from_rpc is not None:
        poller.register(channels.recv_from_rpc, zmq.POLLIN)

    def finish_now(obj: Any, reason: dict[str, Any]) -> None:
        channels.send_to_detokenizer.send_output(
            _batch(io, [(obj, [], reason, len(obj.input_ids or []), 0)], weight_version), obj
        )

    def reply(out: Any, recv: Any) -> None:
        channels.send_to_tokenizer.send_output(out, recv)

    while True:
        busy = bool(running or waiting) and not paused
        events = dict(poller.poll(0 if busy else 50))
        while channels.recv_from_tokenizer in events:
            try:
                obj = io.sock_recv(channels.recv_from_tokenizer, zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            objs = obj.batch if isinstance(obj, io.BatchTokenizedGenerateReqInput) else [obj]
            for one in objs:
                if isinstance(one, io.TokenizedGenerateReqInput):
                    n = len(one.input_ids or [])
                    if n >= max_req_input_len:
                        message = (
                            f"Input length ({n} tokens) exceeds the maximum allowed length "
                            f"({max_req_input_len} tokens). Use a shorter input or enable "
                            "--allow-auto-truncate."
                        )
                        finish_now(one, _abort(message, 400, "BadRequestError"))
                    elif max_queued is not None and len(waiting) >= max_queued:
                        finish_now(one, _abort("The request queue is full.", 503, None))
                    else:
                        waiting.append(_Req(one, eos_id))
                elif isinstance(one, io.AbortReq):
                    for req in [r for r in running + waiting if one.abort_all or r.rid == one.rid]:
                        (running if req in running else waiting).remove(req)
                        finish_now(req.obj, _abort("Abort before prefill", 200, None))
                elif isinstance(one, io.FlushCacheReqInput):
                    ok = not running and not waiting
                    reply(io.FlushCacheReqOutput(success=ok, rid=one.rid), one)
                elif isinstance(one, io.PauseGenerationReqInput):
                    # "abort" is the TokenizerManager's own; "retract" puts the running
                    # requests back in the queue, "in_place" keeps them
                    paused = True
                    if one.mode == "retract":
                        waiting[:0], running[:] = running, []
                elif isinstance(one, io.ContinueGenerationReqInput):
                    paused = False
                elif isinstance(one, io.UpdateWeightFromDiskReqInput):
                    # the weights it started with draw as before; others draw differently
                    same = one.model_path == cfg.model_path
                    weight_salt = b"" if same else hashlib.blake2b(one.model_path.encode()).digest()
                    if one.weight_version is not None:
                        weight_version = one.weight_version
                    reply(
                        io.UpdateWeightFromDiskReqOutput(
                            success=True, message="Succeeded to update model weights.", rid=one.rid
                        ),
                        one,
                    )
                elif isinstance(one, io.ShutdownReq):
                    # the TokenizerManager's last word after a SIGTERM drain: leave the loop
                    return
                elif isinstance(one, io.GetInternalStateReq):
                    state = {
                        "last_gen_throughput": 0.0,
                        "max_total_num_tokens": max_running * context_len,
                        "max_running_requests": max_running,
                        "weight_version": weight_version,
                    }
                    reply(io.GetInternalStateReqOutput(internal_state=state, rid=one.rid), one)
            events.pop(channels.recv_from_tokenizer, None)
            events = dict(poller.poll(0))
        if time.monotonic() - published > LOAD_PUBLISH_S:
            published = time.monotonic()
            _publish_load(loads, running, waiting, max_running, context_len)
        if paused:
            continue
        while waiting and len(running) < max_running:
            running.append(waiting.pop(0))
        if not running:
            continue
        time.sleep(STEP_S)
        items = []
        for req in list(running):
            reason = req.step(weight_salt)
            items.append((req.obj, req.out[req.sent :], reason, req.prompt_len, len(req.out)))
            req.sent = len(req.out)
            if reason is not None:
                running.remove(req)
        channels.send_to_detokenizer.send_output(_batch(io, items, weight_version))


def _load_writer(port_args: Any) -> Any:
    """SGLang's own load snapshot writer, which /v1/loads reads (None if it cannot start)."""
    from sglang.srt.managers.load_snapshot import create_load_snapshot_writer

    try:
        return create_load_snapshot_writer(port_args, 1, 0, publish_interval=1)
    except Exception as error:  # as the real scheduler: /v1/loads then answers empty
        print(f"load snapshot writer init failed: {error}", flush=True)
        return None


def _publish_load(
    writer: Any, running: list[_Req], waiting: list[_Req], max_running: int, context_len: int
) -> None:
    if writer is None:
        return
    from sglang.srt.managers.load_snapshot import LoadSnapshot

    used = sum(r.prompt_len + len(r.out) for r in running)
    pending = sum(r.prompt_len for r in waiting)
    capacity = max_running * context_len
    writer.write(
        LoadSnapshot(
            timestamp=time.time(),
            dp_rank=0,
            num_running_reqs=len(running),
            num_waiting_reqs=len(waiting),
            num_used_tokens=used,
            num_total_tokens=used + pending,
            num_active_tokens=used + pending,
            max_total_num_tokens=capacity,
            max_running_requests=max_running,
            token_usage=used / capacity,
            utilization=len(running) / max_running,
        )
    )


def _abort(message: str, status: int, err_type: str | None) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": status, "err_type": err_type}


Item = tuple[Any, list[int], Any, int, int]


def _batch(io: Any, items: list[Item], version: str) -> Any:
    """A BatchTokenIDOutput for (request, new ids, finish reason or None, prompt length,
    output length so far)."""
    n = len(items)
    empty: list[list[Any]] = [[] for _ in range(n)]
    return io.BatchTokenIDOutput(
        rids=[obj.rid for obj, *_ in items],
        http_worker_ipcs=[obj.http_worker_ipc for obj, *_ in items],
        finished_reasons=[item[2] for item in items],
        decoded_texts=["" for _ in items],
        decode_ids=[array("i", ids) for _, ids, *_ in items],
        read_offsets=[0 for _ in items],
        output_ids=[array("i", ids) for _, ids, *_ in items],
        skip_special_tokens=[obj.sampling_params.skip_special_tokens for obj, *_ in items],
        spaces_between_special_tokens=[
            obj.sampling_params.spaces_between_special_tokens for obj, *_ in items
        ],
        no_stop_trim=[obj.sampling_params.no_stop_trim for obj, *_ in items],
        prompt_tokens=[item[3] for item in items],
        reasoning_tokens=[0 for _ in items],
        completion_tokens=[item[4] for item in items],
        cached_tokens=[0 for _ in items],
        input_token_logprobs_val=empty,
        input_token_logprobs_idx=empty,
        output_token_logprobs_val=empty,
        output_token_logprobs_idx=empty,
        input_top_logprobs_val=empty,
        input_top_logprobs_idx=empty,
        output_top_logprobs_val=empty,
        output_top_logprobs_idx=empty,
        input_token_ids_logprobs_val=empty,
        input_token_ids_logprobs_idx=empty,
        output_token_ids_logprobs_val=empty,
        output_token_ids_logprobs_idx=empty,
        output_token_entropy_val=None,
        output_token_sampling_mask=None,
        output_hidden_states=None,
        routed_experts=None,
        indexer_topk=None,
        placeholder_tokens_idx=None,
        placeholder_tokens_val=None,
        retraction_counts=[0 for _ in items],
    )


def _model_config(folder: str) -> dict[str, Any]:
    import json
    from pathlib import Path

    return dict(json.loads((Path(folder) / "config.json").read_text()))


def _eos_id(folder: str, config: dict[str, Any]) -> int:
    import json
    from pathlib import Path

    generation = Path(folder) / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.exists() else None
    eos = eos if eos is not None else config.get("eos_token_id", 0)
    return int(eos[0] if isinstance(eos, list) else eos)
