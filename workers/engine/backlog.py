"""The window's backlog: claimed jobs waiting for a free slot, and failed ones waiting out their
retry backoff. Thread-safe on its own; slots take from it, the window and its timer put in."""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
from dataclasses import dataclass, field

from workers.engine.window_types import Job

_STOP = object()


@dataclass(order=True)
class _Delayed:
    due: float
    seq: int
    job: Job = field(compare=False)


class Backlog:
    """Jobs in the order they may go out; a stop mark per slot ends the slots' loops."""

    def __init__(self) -> None:
        self._ready: queue.Queue[Job | object] = queue.Queue()
        self._delayed: list[_Delayed] = []  # a heap by due time
        self._seq = itertools.count()  # keeps jobs due at the same moment in order
        self._lock = threading.Lock()  # the heap's (a leaf lock: nothing is called under it)

    def put(self, job: Job) -> None:
        """job may go out now."""
        self._ready.put(job)

    def take(self) -> Job | None:
        """The next job for a slot, waiting for one; None: the slot stops."""
        job = self._ready.get()
        if job is _STOP:
            return None
        assert isinstance(job, Job)
        return job

    def empty(self) -> bool:
        return self._ready.empty()

    def stop_slots(self, n: int) -> None:
        """End n slots' loops once the jobs queued before the marks are taken."""
        for _ in range(n):
            self._ready.put(_STOP)

    def later(self, job: Job, due: float) -> None:
        """job may go out again at due (a retry after its backoff)."""
        with self._lock:
            heapq.heappush(self._delayed, _Delayed(due, next(self._seq), job))

    def due(self, now: float) -> list[Job]:
        """The delayed jobs due by now, out of the delayed heap (the caller puts them)."""
        out: list[Job] = []
        with self._lock:
            while self._delayed and self._delayed[0].due <= now:
                out.append(heapq.heappop(self._delayed).job)
        return out

    def take_waiting(self) -> list[Job]:
        """Every job waiting for a slot or its backoff, out of the backlog (stop marks stay)."""
        jobs: list[Job] = []
        marks = 0
        while True:
            try:
                job = self._ready.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, Job):
                jobs.append(job)
            else:
                marks += 1
        for _ in range(marks):
            self._ready.put(_STOP)
        return jobs + self.drop_delayed()

    def drop_delayed(self) -> list[Job]:
        """Every delayed job, out of the heap (shutting down: they are given back)."""
        with self._lock:
            jobs = [d.job for d in self._delayed]
            self._delayed.clear()
        return jobs
