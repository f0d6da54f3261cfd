"""The prompt stages of an enqueue: template (locally, in a pool for a slow tokenizer) or render
(a server's /v1/tokenize) each planned chunk, then build its ledger items, refusing bad prompts."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from app.core.contracts import PromptRecord
from app.core.errors import InputError, PermanentError
from app.core.images import ImagePins, ImageRef
from app.ledger import queue
from app.prompts.chat_path import ChatInputs, merge_template_kwargs
from app.prompts.image_pins import check_image_prompt
from app.prompts.template_pool import Templater
from app.sglang.render import RenderRequest, prompt_request
from workers.intake import cycles, turns
from workers.intake.images import StoredImages, images_of, refs_json
from workers.intake.reading import PlannedChunk
from workers.intake.reporting import Reporter

PromptIds = list[list[int] | InputError]  # per record: its prompt ids, or why it has none


def row_kwargs(run_kwargs: dict[str, Any], record: PromptRecord) -> dict[str, Any] | None:
    """The record's template kwargs merged over the run's; None when it has none of its own
    (the item then uses the run's)."""
    if record.chat_template_kwargs is None and record.reasoning_effort is None:
        return None
    return merge_template_kwargs(run_kwargs, record.chat_template_kwargs, record.reasoning_effort)


@dataclass
class PromptedChunk:
    """A planned chunk with its prompt ids on the way (templated maybe in another process)."""

    planned: PlannedChunk
    ids: Future[PromptIds]


class PromptSource(Protocol):
    """The template-or-render stage: starts building the prompt ids of a planned chunk."""

    def start(self, planned: PlannedChunk) -> PromptedChunk: ...


class LocalTemplating:
    """Templates the chat records of each chunk with the run's tokenizer (Templater: inline,
    or in its pool of processes for a slow tokenizer); pre-tokenized records keep their ids."""

    def __init__(self, templater: Templater, run_kwargs: dict[str, Any]) -> None:
        self._templater = templater
        self._run_kwargs = run_kwargs

    def start(self, planned: PlannedChunk) -> PromptedChunk:
        return PromptedChunk(planned, self.submit(planned.records))

    def submit(self, records: list[PromptRecord]) -> Future[PromptIds]:
        """The prompt ids of records, in their order, once the templater has them."""
        kwargs = self._run_kwargs
        chat = [
            ChatInputs(
                r.messages or [],
                r.tools,
                row_kwargs(kwargs, r) or kwargs,
                normalized=True,
                assistant_prefix=r.assistant_prefix,
            )
            for r in records
            if r.messages is not None
        ]
        templated = self._templater.submit(chat)
        out: Future[PromptIds] = Future()

        def merge(done: Future[PromptIds]) -> None:
            try:
                rows = iter(done.result())
            except Exception as exc:
                out.set_exception(exc)
                return
            merged: PromptIds = []
            for r in records:
                if r.input_ids is not None:
                    merged.append(list(r.input_ids))
                    continue
                ids = next(rows)
                if isinstance(ids, InputError):  # the line that breaks the template
                    ids = InputError(ids.reason, r.line)
                merged.append(ids)
            out.set_result(merged)

        templated.add_done_callback(merge)
        return out


class Renderer(Protocol):
    """What ServerRendering asks of app.sglang.render.RenderClient."""

    def render_many(
        self, requests: Sequence[RenderRequest]
    ) -> list[list[int] | PermanentError]: ...


class ServerRendering:
    """Asks the render server (`--render-with`) for the prompt ids of each chunk's chat records,
    as local templating gives them; pre-tokenized records keep their ids. Image parts go as
    SGLang takes them, `image_url` parts holding a data URI of the stored bytes. The chunk is
    rendered before start returns; RenderServerUnavailable passes through (the enqueue stops)."""

    def __init__(
        self, client: Renderer, run_kwargs: dict[str, Any], images: StoredImages | None = None
    ) -> None:
        self._client = client
        self._run_kwargs = run_kwargs
        self._images = images

    def start(self, planned: PlannedChunk) -> PromptedChunk:
        ids: Future[PromptIds] = Future()
        ids.set_result(self.render(planned.records))
        return PromptedChunk(planned, ids)

    def render(self, records: list[PromptRecord]) -> PromptIds:
        kwargs = self._run_kwargs
        out: PromptIds = [list(r.input_ids or []) for r in records]
        chat: list[tuple[int, PromptRecord]] = []
        requests: list[RenderRequest] = []
        for i, r in enumerate(records):
            if r.messages is None:
                continue
            messages = r.messages
            if r.images:
                if self._images is None:
                    raise ValueError("a record with images needs ServerRendering's images")
                try:
                    messages = self._images.for_server(messages)
                except InputError as exc:
                    out[i] = InputError(exc.reason, r.line)
                    continue
            chat.append((i, r))
            requests.append(
                prompt_request(
                    messages,
                    row_kwargs(kwargs, r) or kwargs,
                    tools=r.tools,
                    assistant_prefix=r.assistant_prefix,
                )
            )
        rendered = self._client.render_many(requests)
        for (i, r), ids in zip(chat, rendered, strict=True):
            out[i] = (
                InputError(f"the render server refused the prompt: {ids}", r.line)
                if isinstance(ids, Exception)
                else ids
            )
        return out


class ItemBuilder:
    """The build stage: a chunk's prompt ids become its ledger items (one per sample, and the
    waiting later turns of `--turns all`), each with its images in prompt order; an empty
    prompt, one at or over the model's context length, and an image prompt whose ids do not
    hold one placeholder per image (or hold two adjacent) are refused with their line."""

    def __init__(
        self,
        *,
        run_kwargs: dict[str, Any],
        samples_per_prompt: int,
        context_length: int | None,
        reporter: Reporter,
        image_pins: ImagePins | None = None,
        no_pins: str = "",
        chat_pins: dict[str, Any] | None = None,
    ) -> None:
        self._run_kwargs = run_kwargs
        # the run's pins (its tool-call parser): chain_items marks agentic chains' last turns
        self._chat_pins = chat_pins
        self._samples = samples_per_prompt
        self._context = context_length
        self._reporter = reporter
        self._pins = image_pins
        # why the tokenizer has no pins: what an image row is refused with
        self._no_pins = no_pins

    def items(self, chunk: PromptedChunk) -> list[queue.NewItem]:
        """Waits for the chunk's prompt ids, then builds its items."""
        planned = chunk.planned
        new_items: list[queue.NewItem] = []
        built = chunk.ids.result()
        for position, (record, ids) in enumerate(zip(planned.records, built, strict=True)):
            turn = None if planned.turn_of is None else planned.turn_of[position]
            where = "" if turn is None else f"turn {turn}: "
            if not self._accepted(record, ids, where):
                continue
            assert not isinstance(ids, InputError)
            images = images_of(record.messages, record)
            if (images or record.input_ids is not None) and not self._images_accepted(
                record, ids, images, where
            ):
                continue
            merged = row_kwargs(self._run_kwargs, record)
            if turn is not None:
                new_items.extend(self._boundary_items(record, ids, turn, merged, images))
                continue
            plans = planned.plans.get(record.key)
            new_items.extend(
                turns.chain_items(record, ids, self._samples, plans, merged, self._chat_pins)
            )
        return new_items

    def _images_accepted(
        self, record: PromptRecord, ids: list[int], images: list[ImageRef], where: str
    ) -> bool:
        """Whether an image prompt's ids hold one placeholder per image (none adjacent), and a
        pre-tokenized prompt none (its row has no images to fill one)."""
        try:
            if record.input_ids is not None:
                if self._pins is not None and self._pins.placeholder_id in ids:
                    at = ids.index(self._pins.placeholder_id)
                    raise InputError(
                        f"'input_ids'[{at}] is the image placeholder id "
                        f"{self._pins.placeholder_id}; pre-tokenized rows are text only (give "
                        "images as image parts of turns)"
                    )
                return True
            if self._pins is None:
                raise InputError(self._no_pins)
            check_image_prompt(ids, len(images), self._pins)
        except InputError as exc:
            self._reporter.fail(InputError(where + exc.reason, record.line))
            return False
        return True

    def _accepted(self, record: PromptRecord, ids: list[int] | InputError, where: str) -> bool:
        """Whether the record's prompt can be stored; if not, its line is refused."""
        fail = self._reporter.fail
        if isinstance(ids, InputError):
            fail(InputError(where + ids.reason, ids.line))
            return False
        if not ids:
            fail(InputError(f"{where}the prompt is empty after templating", record.line))
            return False
        if self._context is not None and len(ids) >= self._context:
            fail(
                InputError(
                    f"{where}prompt has {len(ids)} tokens, at or over the model's "
                    f"context length {self._context}",
                    record.line,
                )
            )
            return False
        return True

    def _boundary_items(
        self,
        record: PromptRecord,
        ids: list[int],
        turn: int,
        merged: dict[str, Any] | None,
        images: list[ImageRef],
    ) -> list[queue.NewItem]:
        """`--turns each`: the items (one per sample) of one boundary sample of a row."""
        return [
            queue.NewItem(
                record.key,
                k,
                record.line,
                record.messages,
                ids,
                turn,
                tools=record.tools,
                chat_template_kwargs=merged,
                metadata=record.metadata,
                sampling_params=record.sampling_params,
                images=refs_json(images),
                assistant_prefix=record.assistant_prefix,
            )
            for k in cycles.samples_of(record, self._samples)
        ]
