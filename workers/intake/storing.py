"""The store and publish stages of an enqueue: a writer thread inserts each chunk's items (one
transaction a chunk, overlapping the templating of the next), then publishes what is pending."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sqlalchemy import Engine

from app.core.images import ImagePins
from app.ledger import image_tokens, queue
from app.prompts.image_pins import check_run_pins
from workers.intake import turns
from workers.intake.reporting import Reporter

PENDING_PAGE = 5000  # ledger.pending_keys' page
ANALYZE_MIN_ROWS = 20_000  # planner statistics are refreshed once the run has this many rows

Publish = Callable[[list[int]], None]


def pack(groups: Sequence[Sequence[int]], size: int) -> list[list[int]]:
    """Messages of whole groups: consecutive groups share a message up to size ids, and a
    group larger than size is a message of its own (its items must reach one server)."""
    messages: list[list[int]] = []
    current: list[int] = []
    for group in groups:
        if current and len(current) + len(group) > size:
            messages.append(current)
            current = []
        current.extend(group)
    if current:
        messages.append(current)
    return messages


class Publisher:
    """The publish stage: every still-pending item of the run goes out (new ones, and ones a
    crash left behind), then is marked queued. With group_size (`--turns each`), one publish
    call per message, the items of one conversation (one key) together, so they run on one
    server. Remembers the last id published, so each call reads only what is newer."""

    def __init__(
        self,
        db: Engine,
        run_id: int,
        publish: Publish,
        reporter: Reporter,
        *,
        group_size: int | None,
    ) -> None:
        self._db = db
        self._run_id = run_id
        self._publish = publish
        self._reporter = reporter
        self._group_size = group_size
        self._after_id = 0

    def publish_pending(self) -> None:
        if self._group_size is not None:
            self._publish_groups(self._group_size)
            return
        while True:
            with self._db.connect() as conn:
                ids = queue.pending_ids(conn, self._run_id, after_id=self._after_id)
            if not ids:
                return
            self._send(ids)
            self._after_id = ids[-1]

    def _publish_groups(self, size: int) -> None:
        while True:
            with self._db.connect() as conn:
                rows = queue.pending_keys(conn, self._run_id, after_id=self._after_id)
            if not rows:
                return
            groups = [[i for i, _ in g] for _, g in itertools.groupby(rows, key=lambda r: r[1])]
            if len(rows) == PENDING_PAGE and len(groups) > 1:
                groups.pop()  # may go on in the next page: published with the rest of it
            for message in pack(groups, size):
                self._send(message)
            self._after_id = groups[-1][-1]

    def _send(self, ids: list[int]) -> None:
        self._publish(ids)
        with self._db.begin() as conn:
            queue.mark_queued(conn, ids)
        self._reporter.report.published += len(ids)


class Store:
    """The store stage: one writer thread inserts each chunk's items in a transaction of its
    own (linking `--turns all` chains; with the first image items, pinning the run's image
    placeholder), refreshes planner statistics as the run grows, then
    has the publisher send what is pending and reports the progress. One chunk is stored at a
    time: order is kept and memory stays bounded while the next chunks are templated."""

    def __init__(
        self,
        db: Engine,
        run_id: int,
        *,
        link_chains: bool,
        publisher: Publisher | None,
        reporter: Reporter,
        image_pins: ImagePins | None = None,
        run_name: str = "",
    ) -> None:
        self._db = db
        self._run_id = run_id
        self._image_pins = image_pins
        self._run_name = run_name
        self._images_pinned = False
        self._link_chains = link_chains
        self._publisher = publisher
        self._reporter = reporter
        self._analyzed_at = 0  # rows inserted when statistics were last refreshed
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tm-enqueue-writer")
        self._pending: Future[None] | None = None

    def submit(self, new_items: list[queue.NewItem], lines: int) -> None:
        """Store a chunk's items on the writer thread, once the chunk before is stored (its
        error, if any, is raised here)."""
        self.flush()
        self._pending = self._writer.submit(self._store, new_items, lines)

    def flush(self) -> None:
        """Wait until every chunk submitted is stored."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def close(self) -> None:
        self._writer.shutdown(wait=True)

    def _store(self, new_items: list[queue.NewItem], lines: int) -> None:
        report = self._reporter.report
        with self._db.begin() as conn:
            if not self._images_pinned and any(n.images for n in new_items):
                self._pin_images(conn)
            report.inserted += queue.insert_items(conn, self._run_id, new_items)
            if self._link_chains:
                turns.link_chains(conn, self._run_id, new_items)
            self._maybe_analyze(conn, report.inserted)
        if self._publisher is not None:
            self._publisher.publish_pending()
        self._reporter.progress(lines)

    def _pin_images(self, conn: Any) -> None:
        """The run pins the image placeholder its image items were built with (a run pinned
        to another one by a concurrent enqueue refuses them)."""
        assert self._image_pins is not None  # image items are built only with pins
        held = image_tokens.pin_run_images(conn, self._run_id, self._image_pins)
        check_run_pins(held, self._image_pins, self._run_name)
        self._images_pinned = True

    def _maybe_analyze(self, conn: Any, inserted: int) -> None:
        """Refresh planner statistics each time the run has doubled (at least 20,000 rows)."""
        if inserted >= max(ANALYZE_MIN_ROWS, 2 * self._analyzed_at):
            queue.refresh_statistics(conn)
            self._analyzed_at = inserted
