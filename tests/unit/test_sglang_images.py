"""The SGLang client's side of image items: the /generate body (image_data as a list of data
URIs in prompt order, the served prompt ids asked back), the fingerprint's image settings
(only for a server that understands images), their differences, and a 400 passed on.

Servers are faked with httpx.MockTransport; SGLang's facts are from sglang.md ("Images on
/generate") and the 0.5.23 wheel (`/model_info` has `has_image_understanding`)."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import pytest

from app.core.contracts import ServerFingerprint
from app.core.errors import PermanentError
from app.sglang.client import SGLangClient, image_data_uri

PAD = 163605
PROMPT = [163587, 163602, 11, 163603, PAD, 163604, 5, PAD, 6]
TIMEOUTS: dict[str, Any] = {
    "connect_timeout_s": 2.0,
    "generate_timeout_s": 60.0,
    "info_timeout_s": 5.0,
    "probe_timeout_s": 25.0,
}


def client_of(handler: Any) -> SGLangClient:
    return SGLangClient(
        "http://sglang.test:30000", transport=httpx.MockTransport(handler), **TIMEOUTS
    )


def test_image_data_uri_is_the_bytes_in_base64_under_the_formats_mime_type() -> None:
    assert image_data_uri("JPEG", b"\xff\xd8abc") == "data:image/jpeg;base64," + base64.b64encode(
        b"\xff\xd8abc"
    ).decode("ascii")
    assert image_data_uri("PNG", b"x").startswith("data:image/png;base64,")


def test_an_image_request_sends_its_images_in_order_and_asks_for_the_served_ids() -> None:
    sent: list[dict[str, Any]] = []
    served = [*PROMPT[:4], *[PAD] * 3, *PROMPT[5:7], *[PAD] * 2, PROMPT[8]]

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        meta = {"id": "r1", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 12}
        body = {"output_ids": [7, 2], "prompt_token_ids": served, "meta_info": meta}
        return httpx.Response(200, json=body)

    uris = [image_data_uri("PNG", b"first"), image_data_uri("JPEG", b"second")]
    with client_of(handler) as client:
        result = client.generate(PROMPT, {"max_new_tokens": 4}, "r1", image_data=uris)
    body = sent[0]
    assert body["input_ids"] == PROMPT  # one placeholder per image, never expanded
    assert body["image_data"] == uris
    assert body["return_prompt_token_ids"] is True
    assert result.prompt_token_ids == served
    assert result.prompt_tokens == 12


def test_a_text_request_carries_no_image_fields() -> None:
    body = SGLangClient.build_generate_body([1, 2], {"max_new_tokens": 1}, "r")
    assert "image_data" not in body and "return_prompt_token_ids" not in body
    one = SGLangClient.build_generate_body([1, PAD], {}, "r", image_data=["data:image/png;base64,"])
    assert one["image_data"] == ["data:image/png;base64,"]  # a list even for one image


def test_an_over_context_expanded_prompt_fails_at_once_with_the_servers_message() -> None:
    message = "The input (70000 tokens) is longer than the model's context length (65536 tokens)."

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": message}})

    with client_of(handler) as client, pytest.raises(PermanentError) as caught:
        client.generate(PROMPT, {}, "r1", image_data=[image_data_uri("PNG", b"x")] * 2)
    assert message in str(caught.value)


def info_handler(model: dict[str, Any], server: dict[str, Any]) -> Any:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/model_info":
            return httpx.Response(200, json=model)
        return httpx.Response(200, json=server)

    return handler


MODEL = {"model_path": "moonshotai/Kimi-K2.5", "weight_version": "default"}
SERVER = {"version": "0.5.23", "mm_process_config": {"image": {"in_patch_limit": 16384}}}


def test_a_server_that_understands_images_pins_its_image_settings() -> None:
    handler = info_handler({**MODEL, "has_image_understanding": True}, SERVER)
    with client_of(handler) as client:
        fingerprint = client.fingerprint()
    assert fingerprint.reads_images
    assert fingerprint.to_json()["images"] == {
        "mm_process_config": {"image": {"in_patch_limit": 16384}}
    }


@pytest.mark.parametrize("understands", [False, None])
def test_a_text_only_fingerprint_keeps_its_old_json_form(understands: bool | None) -> None:
    model = dict(MODEL) if understands is None else {**MODEL, "has_image_understanding": False}
    with client_of(info_handler(model, SERVER)) as client:
        fingerprint = client.fingerprint()
    assert not fingerprint.reads_images
    assert fingerprint.to_json() == {
        "model_path": "moonshotai/Kimi-K2.5",
        "weight_version": "default",
        "reasoning_parser": None,
        "version": "0.5.23",
    }


def test_differences_name_each_image_setting_between_servers_that_read_images() -> None:
    pinned = ServerFingerprint(version="0.5.23", images={"mm_process_config": {"a": 1}})
    other = ServerFingerprint(
        version="0.5.23",
        images={"mm_process_config": {"a": 2}, "image_processor_backend": "fast"},
    )
    assert pinned.differences(other) == [
        "images.mm_process_config: {'a': 1} → {'a': 2}",
        "images.image_processor_backend: None → fast",
    ]
    assert pinned.differences(pinned) == []


def test_a_server_that_reads_no_images_differs_only_in_what_text_items_see() -> None:
    pinned = ServerFingerprint(version="0.5.23", images={"mm_process_config": {"a": 1}})
    text_only = ServerFingerprint(version="0.5.23")
    assert pinned.differences(text_only) == []
    assert text_only.differences(pinned) == []
    assert pinned.differences(ServerFingerprint(version="0.5.24")) == ["version: 0.5.23 → 0.5.24"]
    # a pinned JSON with images reads back as the same fingerprint
    assert ServerFingerprint(**pinned.to_json()) == pinned
