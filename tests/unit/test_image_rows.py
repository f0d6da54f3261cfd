"""The image fields of exported rows, as logic: served prompts and their masks, image parts
pointed at their uris, the count rules, and compacted prompts read back as sent."""

from __future__ import annotations

import pytest

from app.core.images import ImageRef
from app.ledger import reads
from app.outputs.image_rows import (
    ImageExportError,
    count_problem,
    expanded_mask,
    image_parts,
    served_prompt,
)

PAD = 7
REF = ImageRef("ab" * 32, f"images/{'ab' * 32}.png", 640, 480, "PNG", 1234, "a.png")


def item(prompt: list[int], images: int, counts: list[int] | None) -> reads.StoredItem:
    return reads.StoredItem(
        id=5,
        item_key="k",
        sample_index=0,
        status="done",
        messages=None,
        prompt_ids=prompt,
        output_ids=[90, 91],
        finish_reason="stop",
        completion_tokens=2,
        attempts=1,
        server="gpu-a",
        error=None,
        latency_s=0.1,
        images=[REF.to_json()] * images or None,
        image_token_counts=counts,
    )


def test_the_served_prompt_repeats_each_placeholder_by_its_count() -> None:
    assert served_prompt(item([1, PAD, 2, PAD, 3], 2, [3, 1]), PAD) == [1, PAD, PAD, PAD, 2, PAD, 3]
    assert served_prompt(item([1, 2], 0, None), None) == [1, 2]  # a text item, as stored


@pytest.mark.parametrize(
    ("prompt", "images", "counts", "named"),
    [
        ([1, PAD], 1, None, "1 image(s) and no image_token_counts"),
        ([1, PAD], 1, [2, 3], "2 image_token_counts for 1 image(s)"),
        ([1, PAD], 1, [0], "image_token_counts[0] is 0"),
        ([1, 2], 1, [4], "0 placeholder id(s) 7 in prompt_ids for 1 image(s)"),
        ([1, 2], 0, [4], "image_token_counts [4] on an item with no images"),
    ],
)
def test_counts_that_cannot_rebuild_the_prompt_are_named(
    prompt: list[int], images: int, counts: list[int] | None, named: str
) -> None:
    stored = item(prompt, images, counts)
    assert named in (count_problem(stored, PAD) or "")
    with pytest.raises(ImageExportError, match=r"item 5 \('k', sample 0, turn 0\)"):
        served_prompt(stored, PAD)


def test_an_image_item_of_a_run_without_pins_is_refused() -> None:
    assert "pinned no image placeholder" in (count_problem(item([PAD], 1, [2]), None) or "")


def test_a_mask_stretches_over_each_image_s_tokens() -> None:
    prompt = [1, PAD, 2, PAD]
    mask = [0, 0, 1, 0, 1, 1]  # prompt then two output ids
    assert expanded_mask(prompt, mask, PAD, [3, 2]) == [0, 0, 0, 0, 1, 0, 0, 1, 1]


def test_image_parts_point_at_their_uris_in_prompt_order() -> None:
    turns = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "k1"}}, "x"]},
        {"role": "tool", "content": [{"type": "image", "image": "k2"}]},
        {"role": "assistant", "content": "plain"},
    ]
    out = image_parts(turns, [("u1", "s1"), ("u2", "s2")])
    assert out[0]["content"][0] == {"type": "image_url", "image_url": {"url": "u1"}, "sha256": "s1"}
    assert out[0]["content"][1] == "x"
    assert out[1]["content"][0]["image_url"]["url"] == "u2"
    assert out[2] == turns[2]
    assert turns[0]["content"][0]["image_url"] == {"url": "k1"}  # the stored turns untouched
    with pytest.raises(ValueError, match="more image parts"):
        image_parts(turns, [("u1", "s1")])
    with pytest.raises(ValueError, match="2 image parts for its 3 images"):
        image_parts(turns, [("u1", "s1"), ("u2", "s2"), ("u3", "s3")])


def test_a_compacted_prompt_reads_back_as_it_was_sent() -> None:
    sent = [1, PAD, 2, 3, PAD, 4]
    served = served_prompt(item(sent, 2, [5, 1]), PAD)
    assert reads.request_ids(served, PAD) == sent
    assert reads.request_ids([1, 2], PAD) == [1, 2]
