"""The emulator's weight updates as SGLang 0.5.23 has them (sglang.md, "Weight updates"):
/update_weights_from_disk under the model-update lock, /update_weight_version, live /model_info,
meta_info.weight_versions spans; answers decode with the wheel's api_types, outputs follow the
weights, and the prompt log holds what was sent."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx

from emulator.config import EmulatorConfig
from emulator.model import generate_output
from emulator.server import EmulatorServer
from tests.support.emulator import running_emulator
from tests.support.sglang_contract import decode_response, load_contract

CFG = EmulatorConfig(port=0, step_ms=5, median_tokens=40, weight_version="step-100")
BODY: dict[str, Any] = {
    "input_ids": [5, 6, 7],
    "sampling_params": {"max_new_tokens": 30, "sampling_seed": 3},
}


def run(cfg: EmulatorConfig, scenario: Any) -> Any:
    async def main() -> Any:
        server = EmulatorServer(cfg)
        await server.start()
        try:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=20) as client:
                return await scenario(client)
        finally:
            await server.stop()

    return asyncio.run(main())


def test_an_update_waits_for_requests_in_flight_holds_new_ones_and_changes_the_outputs() -> None:
    cfg = EmulatorConfig(port=0, step_ms=5, median_tokens=40, weight_version="step-100",
                         weight_load_s=0.3)  # fmt: skip

    async def scenario(client: httpx.AsyncClient) -> Any:
        before = asyncio.create_task(client.post("/generate", json=BODY))
        await asyncio.sleep(0.05)
        update = asyncio.create_task(
            client.post(
                "/update_weights_from_disk",
                json={"model_path": "org/step-200", "weight_version": "step-200"},
            )
        )
        await asyncio.sleep(0.05)
        after = asyncio.create_task(client.post("/generate", json=BODY))
        old, updated, new = await before, await update, await after
        info = (await client.get("/model_info")).json()
        server_info = (await client.get("/server_info")).json()
        return old.json(), updated, new.json(), info, server_info

    old, updated, new, info, server_info = run(cfg, scenario)
    # the request in flight finished on the old weights, the one sent during the load on the new
    assert old["meta_info"]["weight_version"] == "step-100"
    assert new["meta_info"]["weight_version"] == "step-200"
    assert old["output_ids"] == generate_output(BODY["input_ids"], BODY["sampling_params"], CFG)[0]
    assert new["output_ids"] != old["output_ids"]
    assert updated.status_code == 200
    assert updated.json() == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to step-200.",
        "num_paused_requests": 0,
    }
    spans = new["meta_info"]["weight_versions"]
    assert spans == [{"version": "step-200", "start": 0, "end": len(new["output_ids"])}]
    decoded = decode_response(new)
    assert decoded.meta_info.weight_versions[0].version == "step-200"
    # /model_info is live; /server_info keeps the launch arguments
    contract = load_contract()
    model = contract.GetModelInfoResponse.from_json_value(info)
    assert (model.model_path, model.weight_version) == ("org/step-200", "step-200")
    assert server_info["weight_version"] == "step-100"
    assert server_info["model_path"] == CFG.model_path


def test_update_weight_version_without_abort_records_spans_and_bad_bodies_are_400() -> None:
    async def scenario(client: httpx.AsyncClient) -> Any:
        long = {"input_ids": [9], "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
        running = asyncio.create_task(client.post("/generate", json=long))
        await asyncio.sleep(0.08)
        changed = await client.post(
            "/update_weight_version", json={"new_version": "v2", "abort_all_requests": False}
        )
        answer = (await running).json()
        aborted = asyncio.create_task(client.post("/generate", json=long))
        await asyncio.sleep(0.05)
        await client.post("/update_weight_version", json={"new_version": "v3"})
        missing = await client.post("/update_weights_from_disk", json={"load_format": "auto"})
        wrong = await client.post("/update_weight_version", json={"new_version": 3})
        failed = await client.post("/update_weights_from_disk", json={"model_path": "/no/such"})
        return changed.json(), answer, (await aborted).json(), missing, wrong, failed

    changed, answer, aborted, missing, wrong, failed = run(CFG, scenario)
    assert changed == {"success": True, "message": "Weight version updated to v2",
                       "new_version": "v2"}  # fmt: skip
    spans = answer["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["step-100", "v2"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0
    assert spans[-1]["end"] == 40 and answer["meta_info"]["weight_version"] == "v2"
    decode_response(answer)
    # abort_all_requests defaults to true
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    for response in (missing, wrong):
        assert response.status_code == 400
        assert response.json()["object"] == "error" and response.json()["code"] == 400
    assert failed.status_code == 400 and failed.json()["success"] is False
    assert failed.json()["message"].startswith("Failed to get weights iterator")


def test_the_prompt_log_holds_every_prompt_as_sent_and_its_weights(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    cfg = EmulatorConfig(step_ms=2, median_tokens=10, prompt_log=str(log), weight_version="a")
    batch = {
        "rid": "b",
        "input_ids": [[1, 2], [3]],
        "sampling_params": [{"max_new_tokens": 5, "temperature": 0.6}, {"max_new_tokens": 6}],
    }
    with running_emulator(cfg) as process:
        assert httpx.post(f"{process.url}/generate", json=batch).status_code == 200
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines == [
        {"rid": "b_0", "input_ids": [1, 2], "sampling_params": batch["sampling_params"][0],
         "weight_version": "a"},
        {"rid": "b_1", "input_ids": [3], "sampling_params": batch["sampling_params"][1],
         "weight_version": "a"},
    ]  # fmt: skip


def _request_fields(member: str, cls: str) -> dict[str, bool]:
    """A request class of the wheel's io_struct: each field and whether it is required (read
    from the source: the module itself imports torch)."""
    import ast
    import zipfile

    from tests.support.sglang_contract import CACHE_DIR, SGLANG_VERSION

    wheel = next(CACHE_DIR.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        tree = ast.parse(archive.read(member))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return {
        stmt.target.id: stmt.value is None
        for stmt in node.body
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
    }


def test_the_update_bodies_take_the_fields_sglangs_request_models_declare() -> None:
    from emulator.weights import DISK_FIELDS, VERSION_FIELDS

    io_struct = "sglang/srt/managers/io_struct.py"
    disk = _request_fields(io_struct, "UpdateWeightFromDiskReqInput")
    version = _request_fields(io_struct, "UpdateWeightVersionReqInput")
    assert set(DISK_FIELDS) - {"rid"} == set(disk)
    assert set(VERSION_FIELDS) - {"rid"} == set(version)
    assert [name for name, required in disk.items() if required] == ["model_path"]
    assert [name for name, required in version.items() if required] == ["new_version"]
