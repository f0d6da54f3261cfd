"""The Celery prefetch follows the window: the messages a worker reserves for a window's room,
and the follower moving kombu's own QoS (the object Celery's consumer holds) by differences."""

from __future__ import annotations

from kombu.common import QoS

from workers.engine import prefetch


def test_messages_cover_the_window_between_two_and_the_threads() -> None:
    assert prefetch.messages_for(20 + 32, batch_size=32, threads=4) == 2
    assert prefetch.messages_for(64 + 32, batch_size=32, threads=4) == 3
    assert prefetch.messages_for(272 + 68, batch_size=32, threads=4) == 4
    assert prefetch.messages_for(1088 + 272, batch_size=32, threads=16) == 16
    assert prefetch.messages_for(5, batch_size=32, threads=16) == 2
    assert prefetch.messages_for(1088, batch_size=32, threads=1) == 1


def test_the_follower_moves_the_consumers_count_and_keeps_celerys_own_steps() -> None:
    sent: list[int] = []
    qos = QoS(lambda prefetch_count: sent.append(prefetch_count), 4)
    qos.update()
    holder: list[QoS] = [qos]
    follower = prefetch.PrefetchFollower(lambda: holder[0], celery_count=4)
    follower.follow(2)
    qos.update()  # what the consumer's loop does when the value moved
    assert sent == [4, 2]
    qos.increment_eventually()  # Celery holds an ETA message
    follower.follow(2)  # no change: nothing moves
    follower.follow(4)
    qos.update()
    assert sent[-1] == 5  # the window's 4 and Celery's ETA message
    qos.decrement_eventually()  # the ETA message ran
    qos.update()
    assert sent[-1] == 4
    # a broker reconnect: the consumer holds a new QoS at Celery's count; moved from there
    fresh = QoS(lambda prefetch_count: sent.append(prefetch_count), 4)
    holder[0] = fresh
    follower.follow(3)
    fresh.update()
    assert sent[-1] == 3 and follower.count == 3


def test_no_consumer_yet_moves_nothing() -> None:
    follower = prefetch.PrefetchFollower(lambda: None, celery_count=4)
    follower.follow(2)
    assert follower.count is None
