"""Celery with the Redis broker; no result backend (Celery's default)."""

from celery import Celery

from bench.peer_apps import record, url

app = Celery("bench", broker=url())
app.conf.task_default_queue = "bench"


@app.task(ignore_result=True)
def noop(tag: str) -> None:
    record(tag)
