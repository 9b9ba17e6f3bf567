"""RQ: the task function its workers import."""

from bench.peer_apps import record


def noop(tag: str) -> None:
    record(tag)
