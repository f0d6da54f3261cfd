"""The exclusive locks that keep two beats from running two watchdogs: on real Redis when the
broker is Redis, and on a file for the embedded broker."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.core.locks import exclusive
from app.core.settings import Settings


@pytest.mark.parametrize("broker", ["redis", "filesystem"])
def test_only_one_holder_at_a_time(broker: str, redis_url: str, tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, broker_url=redis_url if broker == "redis" else None)
    with exclusive(settings, "watchdog", ttl_s=30) as first:
        assert first
        with exclusive(settings, "watchdog", ttl_s=30) as second:
            assert not second
        with exclusive(settings, "other", ttl_s=30) as other:
            assert other
    with exclusive(settings, "watchdog", ttl_s=30) as again:
        assert again


def test_redis_lock_expires_when_its_holder_dies(redis_url: str, tmp_path: Path) -> None:
    import redis

    settings = Settings(data_dir=tmp_path, broker_url=redis_url)
    client = redis.Redis.from_url(redis_url)
    client.set("tokenmill:lock:watchdog", "someone-dead", px=50)
    with exclusive(settings, "watchdog", ttl_s=30) as held:
        assert not held
    import time

    time.sleep(0.1)
    with exclusive(settings, "watchdog", ttl_s=30) as held:
        assert held
    # releasing never deletes a lock someone else took over
    with exclusive(settings, "watchdog", ttl_s=0.05) as held:
        assert held
        time.sleep(0.1)
        client.set("tokenmill:lock:watchdog", "new-owner", px=5000)
    assert client.get("tokenmill:lock:watchdog") == b"new-owner"
