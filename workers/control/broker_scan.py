"""What the broker still holds: item ids in queued and unacknowledged generate messages.

Lets reconcile find items the ledger says are queued but that no message carries any more
(Redis restarted without persistence). Only Redis brokers can be read; others return None.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any, cast

from app.core.constants import GENERATE_TASK, PRIORITY_SEP, WORK_QUEUE
from app.core.errors import BrokerUnavailable
from app.core.settings import redact_url

log = logging.getLogger(__name__)

UNACKED_KEY = "unacked"
UNACKED_INDEX_KEY = "unacked_index"  # delivery tag -> time of delivery
# ids a message carries at TOKENMILL_BATCH_SIZE's default: only sizes the first chunk read
_IDS_PER_MESSAGE = 32


def _ids_in_message(raw: bytes | str) -> list[int]:
    try:
        message: Any = json.loads(raw)
        if isinstance(message, list):  # unacked entries are [message, exchange, routing key]
            message = message[0]
        if message.get("headers", {}).get("task") != GENERATE_TASK:
            return []
        body = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return [int(i) for i in args[0]]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        log.debug("unreadable broker message skipped (%s)", exc)
        return []


@dataclass(frozen=True)
class BrokerCheck:
    """Which of the ids asked about a generate message carries, and whether every queued
    message was read (only then is an id not found known to be missing)."""

    found: set[int]
    complete: bool


def broker_holds(
    broker_url: str,
    wanted: Collection[int],
    *,
    unacked_grace_s: float,
    max_messages: int,
) -> BrokerCheck | None:
    """Look for these ids in the broker, or None if it cannot tell.

    Bounded: queued messages are read from the end workers consume from (Redis lists are
    pushed on the left and popped on the right), so the longest-queued items are met first;
    the read stops once every id is found or after max_messages messages (then `complete`
    is False). Unacknowledged messages count while younger than unacked_grace_s, as in
    broker_item_ids. Memory holds the wanted ids only, never every id in the broker.
    """
    if not broker_url.startswith(("redis://", "rediss://")):
        return None
    import redis

    want = set(wanted)
    found: set[int] = set()
    client = redis.Redis.from_url(broker_url, socket_timeout=30, socket_connect_timeout=5)
    try:
        return _holds(client, want, found, unacked_grace_s, max_messages)
    except redis.RedisError as exc:
        raise BrokerUnavailable(
            f"the broker {redact_url(broker_url)} cannot be read: {exc}"
        ) from exc
    finally:
        client.close()


def _recent_unacked(client: Any, unacked_grace_s: float) -> Iterator[bytes]:
    """The unacknowledged messages delivered less than unacked_grace_s ago."""
    now_s = float(client.time()[0])
    recent = cast(
        list[bytes], client.zrangebyscore(UNACKED_INDEX_KEY, now_s - unacked_grace_s, "+inf")
    )
    for start in range(0, len(recent), 500):
        for entry in client.hmget(UNACKED_KEY, recent[start : start + 500]):
            if entry is not None:
                yield entry


def _holds(
    client: Any, want: set[int], found: set[int], unacked_grace_s: float, max_messages: int
) -> BrokerCheck:
    """broker_holds' read, on an open client."""
    for entry in _recent_unacked(client, unacked_grace_s):
        found.update(want.intersection(_ids_in_message(entry)))
    read = 0
    keys = [WORK_QUEUE.encode(), *client.scan_iter(match=f"{WORK_QUEUE}{PRIORITY_SEP}*")]
    for key in keys:
        if client.type(key) != b"list":
            continue
        length, start = int(client.llen(key)), 0
        # chunks grow from what the wanted ids fill (they are the longest-queued, met
        # first) to 1,000, and decoding stops at the message that holds the last of them
        step = max(16, min(1000, 2 * len(want) // max(1, _IDS_PER_MESSAGE)))
        while start < length:
            if found >= want:
                return BrokerCheck(found, complete=True)
            if read >= max_messages:
                return BrokerCheck(found, complete=False)
            size = min(step, max_messages - read)
            step = min(1000, 2 * step)
            chunk = client.lrange(key, -(start + size), -(start + 1))
            if not chunk:
                break
            start += size
            for raw in reversed(chunk):
                read += 1
                found.update(want.intersection(_ids_in_message(raw)))
                if found >= want:
                    return BrokerCheck(found, complete=True)
    return BrokerCheck(found, complete=True)


def broker_item_ids(broker_url: str, *, unacked_grace_s: float | None = None) -> set[int] | None:
    """Every item id a generate message in the broker carries, or None if it cannot tell.

    Messages a worker fetched but has not acknowledged count only while their delivery is
    younger than unacked_grace_s: a worker killed while holding one leaves it there until the
    visibility timeout (hours), and its items must not wait that long.
    """
    if not broker_url.startswith(("redis://", "rediss://")):
        return None
    import redis

    client = redis.Redis.from_url(broker_url, socket_timeout=30, socket_connect_timeout=5)
    try:
        found: set[int] = set()
        keys = [WORK_QUEUE.encode(), *client.scan_iter(match=f"{WORK_QUEUE}{PRIORITY_SEP}*")]
        for key in keys:
            if client.type(key) != b"list":
                continue
            for start in range(0, int(client.llen(key)), 1000):
                for raw in client.lrange(key, start, start + 999):
                    found.update(_ids_in_message(raw))
        if unacked_grace_s is None:
            for _, raw in client.hscan_iter(UNACKED_KEY):
                found.update(_ids_in_message(raw))
            return found
        for entry in _recent_unacked(client, unacked_grace_s):
            found.update(_ids_in_message(entry))
        return found
    finally:
        client.close()
