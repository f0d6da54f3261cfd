"""Images on the emulator's /generate over HTTP, as SGLang 0.5.23 takes them (sglang.md, "Images
on /generate"): Kimi and Qwen modes, the text-only default, errors, cache and outputs.

Counts are checked against SGLang's and transformers' own code (tests.support.vision_reference);
every image is made here with Pillow; each emulator is `python -m emulator` in a subprocess.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.core.images import ImageDrift, expand_placeholders, served_counts
from emulator.config import EmulatorConfig
from emulator.fixtures.qwen_vl import SPECIAL_TOKENS_BY_NAME, ensure_qwen_vl_tokenizer
from tests.support.emulator import EmulatorProcess, running_emulator
from tests.support.sglang_contract import decode_response, validate_request
from tests.support.vision_reference import (
    data_uri,
    kimi_reference_count,
    png,
    qwen_reference_count,
)

Json = dict[str, Any]
MEDIA_PAD = 163605
IMAGE_PAD = SPECIAL_TOKENS_BY_NAME["<|image_pad|>"]
VISION_START = SPECIAL_TOKENS_BY_NAME["<|vision_start|>"]
VISION_END = SPECIAL_TOKENS_BY_NAME["<|vision_end|>"]
ENDOFTEXT = SPECIAL_TOKENS_BY_NAME["<|endoftext|>"]
KIMI = EmulatorConfig(port=0, step_ms=1, median_tokens=6, context_length=4096, mm="kimi")
HTTP = httpx.Client(timeout=20.0)
# sampled, with a seed: outputs are a function of the prompt (and its images) only
SAMPLING = {"max_new_tokens": 8, "temperature": 0.7, "sampling_seed": 11}


def post(emu: EmulatorProcess, body: Json) -> httpx.Response:
    return HTTP.post(f"{emu.url}/generate", json=body)


def generate(emu: EmulatorProcess, body: Json) -> Any:
    validate_request(body)
    response = post(emu, body)
    assert response.status_code == 200, response.text
    answer = response.json()
    decode_response(answer)
    return answer


def body(ids: list[int], images: Any, **extra: Any) -> Json:
    return {
        "input_ids": ids,
        "image_data": images,
        "sampling_params": SAMPLING,
        "return_prompt_token_ids": True,
        **extra,
    }


@pytest.fixture(scope="module")
def kimi() -> Iterator[EmulatorProcess]:
    with running_emulator(KIMI) as emu:
        yield emu


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_qwen_vl_tokenizer(tmp_path_factory.mktemp("tokenizers"))


def qwen_config(folder: Path, **changes: Any) -> EmulatorConfig:
    base = dataclasses.replace(KIMI, mm="qwen", tokenizer=str(folder), eos_id=151645)
    return dataclasses.replace(base, **changes)


@pytest.fixture(scope="module")
def qwen(qwen_folder: Path) -> Iterator[EmulatorProcess]:
    with running_emulator(qwen_config(qwen_folder)) as emu:
        yield emu


@pytest.fixture(scope="module")
def qwen_drift(qwen_folder: Path) -> Iterator[EmulatorProcess]:
    with running_emulator(qwen_config(qwen_folder, mm_retokenize=True)) as emu:
        yield emu


# --- Kimi -------------------------------------------------------------------------------


def test_kimi_expands_each_placeholder_to_its_navit_count(
    kimi: EmulatorProcess, tmp_path: Path
) -> None:
    on_disk = tmp_path / "wide.png"
    on_disk.write_bytes(png(1200, 300))
    images = [
        data_uri(png(640, 480)),
        f"file://{on_disk}",
        str(on_disk),
        {"url": base64.b64encode(png(300, 200)).decode()},
    ]
    ids = [10, MEDIA_PAD, 11, 12, MEDIA_PAD, 15, MEDIA_PAD, 13, MEDIA_PAD, 14]
    answer = generate(kimi, body(ids, images))
    counts = [
        kimi_reference_count(640, 480),
        kimi_reference_count(1200, 300),
        kimi_reference_count(1200, 300),
        kimi_reference_count(300, 200),
    ]
    assert counts[0] == 414 and counts[3] == 88  # sglang.md's worked examples
    served = expand_placeholders(ids, MEDIA_PAD, counts)
    assert answer["prompt_token_ids"] == served
    assert served_counts(ids, answer["prompt_token_ids"], MEDIA_PAD) == counts
    assert answer["meta_info"]["prompt_tokens"] == len(served)
    assert answer["meta_info"]["image_tokens"] == sum(counts)


def test_kimi_refuses_placeholders_that_do_not_match_the_images(kimi: EmulatorProcess) -> None:
    image = data_uri(png(64, 64))
    expanded = [1] + [MEDIA_PAD] * kimi_reference_count(64, 64) + [2]
    for ids, images, found in (
        ([1, 2], [image], 0),
        ([1, MEDIA_PAD, MEDIA_PAD], [image], 2),
        (expanded, [image], kimi_reference_count(64, 64)),  # an already-expanded prompt
    ):
        response = post(kimi, body(ids, images))
        assert response.status_code == 400
        assert response.json() == {
            "error": {
                "message": "Kimi image placeholders must map one-to-one to image data: "
                f"expected {len(images)}, found {found} token(s)"
            }
        }


def test_kimi_refuses_caller_identities_and_reports_loader_errors(
    kimi: EmulatorProcess, tmp_path: Path
) -> None:
    ids = [1, MEDIA_PAD, 2]
    image = data_uri(png(32, 32))
    with_hash = post(kimi, body(ids, [{"url": image, "hash": "abc"}]))
    assert with_hash.status_code == 400
    assert with_hash.json()["error"].startswith("unknown field `hash`, expected one of `url`")
    hashes = post(kimi, body(ids, [image], mm_hashes=["ab"]))
    assert hashes.json() == {
        "error": {"message": "Caller-supplied mm_hashes are not supported for Kimi."}
    }
    broken = post(kimi, body(ids, [data_uri(b"no image here")]))
    assert broken.status_code == 400
    assert broken.json()["error"]["message"].startswith(
        "An exception occurred while loading IMAGE data at index 0: Error while loading data "
        "b'no image here': Could not decode image: "
    )
    missing = post(kimi, body(ids, [str(tmp_path / "gone.png")]))
    assert missing.status_code == 500
    assert missing.text.startswith(
        "An exception occurred while loading IMAGE data at index 0: [Errno 2]"
    )


def test_outputs_and_the_prefix_cache_follow_the_image_content(kimi: EmulatorProcess) -> None:
    ids = [21, 22, 23, MEDIA_PAD, 24, 25]
    red, blue = data_uri(png(96, 96)), data_uri(png(96, 96, (20, 20, 220)))
    first = generate(kimi, body(ids, [red]))
    again = generate(kimi, body(ids, [red]))
    other = generate(kimi, body(ids, [blue]))
    assert first["prompt_token_ids"] == other["prompt_token_ids"]
    assert again["output_ids"] == first["output_ids"]
    assert other["output_ids"] != first["output_ids"]
    span_end = 3 + kimi_reference_count(96, 96)
    # the same image behind the same ids is served from cache past its span; another is not
    assert again["meta_info"]["cached_tokens"] >= span_end
    assert other["meta_info"]["cached_tokens"] <= 3


def test_kimi_batch_images_and_the_context_check_on_expanded_length(tmp_path: Path) -> None:
    prompt_log = tmp_path / "prompts.jsonl"
    cfg = dataclasses.replace(KIMI, context_length=600, prompt_log=str(prompt_log))
    with running_emulator(cfg) as emu:
        big, small = data_uri(png(640, 480)), data_uri(png(300, 200))
        batch = {
            "input_ids": [[1, MEDIA_PAD], [2, MEDIA_PAD, MEDIA_PAD]],
            "image_data": [[small], [small, small]],
            "sampling_params": SAMPLING,
            "return_prompt_token_ids": True,
        }
        answers = generate(emu, batch)
        assert [a["meta_info"]["prompt_tokens"] for a in answers] == [1 + 88, 1 + 2 * 88]
        logged = [json.loads(line)["input_ids"] for line in prompt_log.read_text().splitlines()]
        assert logged == batch["input_ids"]  # the prompt log keeps the ids as sent
        wrong_length = post(emu, {**batch, "image_data": [small, small, small]})
        assert wrong_length.json() == {
            "error": {"message": "The length of image_data should be equal to the batch size."}
        }
        ids = [5] * 200 + [MEDIA_PAD]
        response = post(emu, body(ids, [big], sampling_params={"max_new_tokens": 1}))
        assert response.status_code == 400
        expanded = 200 + kimi_reference_count(640, 480)
        assert response.json() == {
            "error": {
                "message": f"The input ({expanded} tokens) is longer than the model's context "
                "length (600 tokens)."
            }
        }
        before = HTTP.get(f"{emu.url}/emulator/stats").json()["vision_tokens"]
        generate(emu, body([7, MEDIA_PAD], [data_uri(png(300, 201))]))
        after = HTTP.get(f"{emu.url}/emulator/stats").json()["vision_tokens"]
        assert after - before == kimi_reference_count(300, 201)  # the encoder's prefill work


def test_kimi_info_and_the_process_config_change_the_counts(kimi: EmulatorProcess) -> None:
    assert HTTP.get(f"{kimi.url}/model_info").json()["has_image_understanding"] is True
    info = HTTP.get(f"{kimi.url}/server_info").json()
    assert info["mm_process_config"] == {}
    assert info["enable_multimodal"] is True
    limits = {"in_patch_limit": 1024, "patch_limit_on_one_side": 40}
    cfg = dataclasses.replace(KIMI, mm_process_config=json.dumps({"image": limits}))
    with running_emulator(cfg) as emu:
        info = HTTP.get(f"{emu.url}/server_info").json()
        assert info["mm_process_config"] == {"image": limits}
        answer = generate(emu, body([1, MEDIA_PAD], [data_uri(png(1600, 900))]))
        count = kimi_reference_count(1600, 900, **limits)
        assert count != kimi_reference_count(1600, 900)
        assert answer["meta_info"]["image_tokens"] == count


def test_a_text_only_emulator_ignores_image_data() -> None:
    cfg = dataclasses.replace(KIMI, mm=None)
    with running_emulator(cfg) as emu:
        ids = [1, MEDIA_PAD, 2]
        answer = generate(emu, body(ids, [data_uri(b"not even an image")]))
        assert answer["prompt_token_ids"] == ids
        assert "image_tokens" not in answer["meta_info"]
        model = HTTP.get(f"{emu.url}/model_info").json()
        assert model["has_image_understanding"] is False
        assert HTTP.get(f"{emu.url}/server_info").json()["enable_multimodal"] is None


# --- Qwen -------------------------------------------------------------------------------


def qwen_ids(folder: Path, text: str) -> list[int]:
    """The fixture's canonical ids of a user turn holding one image, then text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    ids: list[int] = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    return ids


def byte_split(folder: Path, ids: list[int]) -> list[int]:
    """The same text as ids, but every ordinary token spelled as its single bytes: what a
    client whose tokenizer differs would send (ids 0..255 are the fixture's bytes)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    out: list[int] = []
    for token in ids:
        if token >= 151643:
            out.append(token)
        else:
            out.extend(
                tokenizer.convert_tokens_to_ids(list(tokenizer.convert_ids_to_tokens(token)))
            )
    return out


def test_qwen_keeps_the_callers_ids_and_expands_the_pad(
    qwen: EmulatorProcess, qwen_folder: Path
) -> None:
    ids = qwen_ids(qwen_folder, "Describe this picture in one sentence.")
    image = data_uri(png(640, 480))
    count = qwen_reference_count(640, 480)
    answer = generate(qwen, body(ids, [image]))
    assert answer["prompt_token_ids"] == expand_placeholders(ids, IMAGE_PAD, [count])
    assert answer["meta_info"]["image_tokens"] == count
    # ids the server's tokenizer would split otherwise are kept too
    odd = byte_split(qwen_folder, ids)
    assert odd != ids
    kept = generate(qwen, body(odd, [image]))
    assert served_counts(odd, kept["prompt_token_ids"], IMAGE_PAD) == [count]


def test_qwens_re_tokenize_fallback_drifts(qwen_drift: EmulatorProcess, qwen_folder: Path) -> None:
    ids = qwen_ids(qwen_folder, "Describe this picture in one sentence.")
    image = data_uri(png(640, 480))
    count = qwen_reference_count(640, 480)
    expanded = expand_placeholders(ids, IMAGE_PAD, [count])
    # the fixture's tokenizer adds <|endoftext|> when it re-tokenizes (emulator.fixtures.qwen_vl)
    drifted = generate(qwen_drift, body(ids, [image]))
    assert drifted["prompt_token_ids"] == [ENDOFTEXT, *expanded]
    assert drifted["meta_info"]["prompt_tokens"] == len(expanded) + 1
    with pytest.raises(ImageDrift, match="request position 0"):
        served_counts(ids, drifted["prompt_token_ids"], IMAGE_PAD)
    # and it re-splits ids the tokenizer would split otherwise into its own split
    odd = generate(qwen_drift, body(byte_split(qwen_folder, ids), [image]))
    assert odd["prompt_token_ids"] == [ENDOFTEXT, *expanded]


def test_qwen_errors(qwen: EmulatorProcess, qwen_folder: Path) -> None:
    ids = qwen_ids(qwen_folder, "What is it?")
    thin = post(qwen, body(ids, [data_uri(png(2010, 10))]))
    assert thin.status_code == 400
    assert thin.json()["error"]["message"].startswith(
        "absolute aspect ratio must be smaller than 200, got 201"
    )
    group = [VISION_START, IMAGE_PAD, VISION_END]
    image = data_uri(png(56, 56))
    two = post(qwen, body([1, *group, 2, *group], [image]))
    assert two.json() == {
        "error": {"message": "Prompt has 2 image placeholders but 1 image inputs were provided"}
    }
    doubled = post(qwen, body([1, VISION_START, IMAGE_PAD, IMAGE_PAD, VISION_END], [image]))
    assert doubled.json()["error"]["message"].startswith(
        "The total number of <|image_pad|> tokens in the prompts should be the same as the "
        "number of images passed. Found total 2 <|image_pad|> tokens and 1 images."
    )
    relative = post(qwen, body(ids, ["picture.png"]))
    assert relative.status_code == 400
    assert relative.json()["error"]["message"].startswith(
        "An exception occurred while loading IMAGE data at index 0: Error while loading data "
        "picture.png: "
    )


def test_qwen_process_config_changes_the_counts(qwen_folder: Path) -> None:
    bounds = {"min_pixels": 3136, "max_pixels": 100_000}
    cfg = qwen_config(qwen_folder, mm_process_config=json.dumps({"image": bounds}))
    with running_emulator(cfg) as emu:
        model = HTTP.get(f"{emu.url}/model_info").json()
        assert model["has_image_understanding"] is True
        assert model["model_type"] == "qwen2_5_vl"
        info = HTTP.get(f"{emu.url}/server_info").json()
        assert info["mm_process_config"] == {"image": bounds}
        ids = qwen_ids(qwen_folder, "Hi")
        answer = generate(emu, body(ids, [data_uri(png(1024, 768))]))
        count = qwen_reference_count(1024, 768, **bounds)
        assert count != qwen_reference_count(1024, 768)
        assert answer["meta_info"]["image_tokens"] == count
