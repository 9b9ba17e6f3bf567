"""The scheduler checked by a model, long (issue 46): tests/support/scheduler_model.py's state
machine, as tests/daemon/queue/test_stateful_scheduler.py runs it in `make test`, with many more
and longer examples, drawn afresh at each run (a failure prints its steps and the seed to
reproduce it with). `make chaos` runs it."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, Phase, settings

from daemon.queue.embedded_redis import EmbeddedRedis
from tests.support.scheduler_model import STATS, run_machine

LONG = settings(
    max_examples=600,
    stateful_step_count=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
    # No explain phase: it reruns a failing example at length, after the shrink that says more.
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_stateful_scheduler_keeps_its_invariants_long(redis_server: EmbeddedRedis) -> None:
    """Issue 46: the model's invariants (tests/support/scheduler_model.py) after every step of
    many long random runs of enqueues, claims, ends, cancels, requeues, hand-backs and reclaims
    under every mix of caps, fair share, preemption and retry back-off."""
    STATS.clear()
    began = time.monotonic()
    run_machine(redis_server, LONG)
    print(f"stateful: {dict(STATS)} in {time.monotonic() - began:.1f} s")
