"""Prompt templating in parallel processes for slow (pure-Python) tokenizers, results in order.

Each process loads the tokenizer once from its folder; a fast tokenizer is templated inline.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor

from app.core.errors import InputError
from app.prompts.chat_path import ChatInputs
from app.prompts.template_choice import TemplateChoice
from app.prompts.tokenization import ChatTokenizer, load_tokenizer

logger = logging.getLogger(__name__)

# one tokenizer per worker process, loaded by the pool's initializer
_process_tokenizer: ChatTokenizer | None = None

Result = list[int] | InputError


def default_processes() -> int:
    """One process per core this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class Templater:
    """`ChatTokenizer.apply_each` on batches, each batch's result in the order submitted.

    A slow tokenizer's batches go to a pool of `processes` processes, started (spawned, as the
    caller may hold threads and connections) at the second batch; until every process has
    loaded the tokenizer, batches are templated here, so a small file never waits for the
    pool. The ids are the same either way. A fast tokenizer encodes batches on all cores
    already and is templated inline.
    """

    def __init__(self, tokenizer: ChatTokenizer, processes: int | None = None) -> None:
        self._tokenizer = tokenizer
        wanted = default_processes() if processes is None else processes
        self._processes = 1 if tokenizer.is_fast else max(1, wanted)
        self._pool: ProcessPoolExecutor | None = None
        self._warmups: list[Future[int]] = []
        self._batches = 0
        self.pooled_batches = 0  # batches templated by the pool (the others here)

    @property
    def processes(self) -> int:
        """How many processes template at once (1: this process only)."""
        return self._processes

    def submit(self, batch: Sequence[ChatInputs]) -> Future[list[Result]]:
        self._batches += 1
        if self._processes > 1 and self._batches > 1 and self._pool is None:
            self._start()
        if self._pool is not None and self._ready():
            self.pooled_batches += 1
            remote = self._pool.submit(_apply_each, list(batch))
            done: Future[list[Result]] = Future()
            remote.add_done_callback(lambda f: _relay(f, done))
            return done
        # no pool, or its processes still loading the tokenizer: template here meanwhile
        inline: Future[list[Result]] = Future()
        try:
            inline.set_result(self._tokenizer.apply_each(batch))
        except Exception as exc:
            inline.set_exception(exc)
        return inline

    def warm_up(self) -> None:
        """Start the pool now (a slow tokenizer) and wait until every process has loaded it."""
        if self._processes > 1:
            if self._pool is None:
                self._start()
            for warmup in self._warmups:
                warmup.result()

    def _ready(self) -> bool:
        """Every pool process has loaded the tokenizer (a failed load is raised here)."""
        if not all(f.done() for f in self._warmups):
            return False
        for warmup in self._warmups:
            warmup.result()
        return True

    def _start(self) -> ProcessPoolExecutor:
        logger.info(
            "templating in %d processes (slow tokenizer %s)",
            self._processes,
            self._tokenizer.path,
            extra={"action": "template_pool_started"},
        )
        self._pool = ProcessPoolExecutor(
            max_workers=self._processes,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_load,
            initargs=(
                str(self._tokenizer.path),
                self._tokenizer.trust_remote_code,
                self._tokenizer.tokenizer_hash,
                TemplateChoice(self._tokenizer.template.name, self._tokenizer.template.file),
                self._tokenizer.pass_turn_fields,
            ),
        )
        # one task per process that returns once its initializer has loaded the tokenizer
        self._warmups = [self._pool.submit(_warm, k) for k in range(self._processes)]
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Templater:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _relay(remote: Future[list[list[int] | str]], done: Future[list[Result]]) -> None:
    try:
        rows = remote.result()
    except Exception as exc:
        done.set_exception(exc)
        return
    done.set_result([InputError(row) if isinstance(row, str) else row for row in rows])


def _load(
    path: str,
    trust_remote_code: bool,
    tokenizer_hash: str,
    template: TemplateChoice,
    pass_turn_fields: bool,
) -> None:
    global _process_tokenizer
    tokenizer = load_tokenizer(
        path,
        trust_remote_code=trust_remote_code,
        template=template,
        pass_turn_fields=pass_turn_fields,
    )
    if tokenizer.tokenizer_hash != tokenizer_hash:  # the folder changed under the enqueue
        raise RuntimeError(f"the tokenizer files in {path} changed while templating")
    _process_tokenizer = tokenizer


def _warm(k: int) -> int:
    """A task that needs only the loaded tokenizer; it holds its process a moment so that
    each warm-up task lands in another process."""
    time.sleep(0.2)
    return k


def _apply_each(batch: list[ChatInputs]) -> list[list[int] | str]:
    """In a pool process: ids, or the reason an entry failed (a string pickles safely)."""
    assert _process_tokenizer is not None, "the pool initializer loads the tokenizer"
    return [
        row.reason if isinstance(row, InputError) else row
        for row in _process_tokenizer.apply_each(batch)
    ]
