"""Dramatiq with its Redis broker, default middleware."""

import dramatiq
from dramatiq.brokers.redis import RedisBroker

from bench.peer_apps import record, url

dramatiq.set_broker(RedisBroker(url=url()))


@dramatiq.actor(queue_name="bench")
def noop(tag: str) -> None:
    record(tag)
