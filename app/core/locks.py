"""Short-lived exclusive locks across processes: Redis when the broker is Redis, else a file.

Guards the watchdog (two beats must not run two watchdogs) and probes of one server.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from app.core.constants import REDIS_PREFIX
from app.core.settings import Settings

log = logging.getLogger(__name__)


@contextlib.contextmanager
def exclusive(settings: Settings, name: str, ttl_s: float) -> Iterator[bool]:
    """Yield True if this process holds the lock `name` (expiring after ttl_s), else False."""
    broker = settings.resolved_broker_url()
    if broker.startswith(("redis://", "rediss://")):
        with _redis_lock(broker, name, ttl_s) as held:
            yield held
    else:
        with _file_lock(settings.data_dir / "locks" / f"{name}.lock") as held:
            yield held


@contextlib.contextmanager
def _redis_lock(url: str, name: str, ttl_s: float) -> Iterator[bool]:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
    # redis-py's Lock: SET NX PX with a random token, released only by its holder (a script
    # compares the token), so a lock that expired and was taken by another is never deleted
    lock = client.lock(f"{REDIS_PREFIX}lock:{name}", timeout=ttl_s, blocking=False)
    try:
        held = lock.acquire()
        try:
            yield held
        finally:
            if held:
                with contextlib.suppress(redis.exceptions.LockError):  # expired meanwhile
                    lock.release()
    finally:
        client.close()


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[bool]:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle: IO[str] = path.open("a")
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        handle.write(f"{os.getpid()} {time.time():.0f}\n")
        handle.flush()
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    finally:
        handle.close()
