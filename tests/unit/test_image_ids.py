"""The served prompt of an image request: the request ids with each placeholder repeated."""

from __future__ import annotations

import pytest

from app.core.images import (
    ImageDrift,
    ImagePins,
    ImageRef,
    adjacent_placeholders,
    expand_placeholders,
    served_counts,
    store_key,
)

PAD = 9


def test_counts_are_read_back_from_the_expansion() -> None:
    request = [1, PAD, 2, 3, PAD, 4]
    served = expand_placeholders(request, PAD, [4, 1])
    assert served == [1, PAD, PAD, PAD, PAD, 2, 3, PAD, 4]
    assert served_counts(request, served, PAD) == [4, 1]


def test_a_prompt_without_images_is_served_as_sent() -> None:
    assert served_counts([1, 2, 3], [1, 2, 3], PAD) == []


@pytest.mark.parametrize(
    ("served", "named"),
    [
        # the re-tokenize fallback merged two ids after the image
        ([1, PAD, PAD, 23, PAD, 4], "request position 2 (id 2)"),
        # an image's placeholder dropped
        ([1, 2, 3, PAD, 4], "request position 1 (id 9) should be served as its image"),
        # an id added at the end
        ([1, PAD, 2, 3, PAD, 4, 5], "1 id(s) past the request's end"),
        # the prompt cut short
        ([1, PAD, 2, 3, PAD], "which is the end of the prompt"),
    ],
)
def test_anything_else_is_drift_naming_the_first_difference(served: list[int], named: str) -> None:
    with pytest.raises(ImageDrift, match=named.replace("(", r"\(").replace(")", r"\)")):
        served_counts([1, PAD, 2, 3, PAD, 4], served, PAD)


def test_expansion_needs_one_count_per_placeholder() -> None:
    with pytest.raises(ValueError, match="2 placeholders but 1 counts"):
        expand_placeholders([PAD, 1, PAD], PAD, [3])


def test_adjacent_placeholders_are_found() -> None:
    assert adjacent_placeholders([1, PAD, 2, PAD], PAD) is None
    assert adjacent_placeholders([1, PAD, PAD, 2], PAD) == 2


def test_records_round_trip_through_json() -> None:
    ref = ImageRef("ab" * 32, store_key("ab" * 32, "JPEG"), 640, 480, "JPEG", 1234, "a/b.jpg")
    assert ref.key == f"images/{'ab' * 32}.jpg"
    assert ImageRef.from_json(ref.to_json()) == ref
    pins = ImagePins("kimi", "<|media_pad|>", 163605, "<|media_begin|>image...")
    assert ImagePins.from_json(pins.to_json()) == pins
