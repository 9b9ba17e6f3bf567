"""The scheduler checked by a model, long (issue 46): tests/support/scheduler_model.py's state
machine, as tests/daemon/queue/test_stateful_scheduler.py runs it in `make test`, with many more
and longer examples, drawn afresh at each run (a failure prints its steps and
the blob that replays it), on one redis-server and on a Redis Cluster. `make chaos` runs it."""

from __future__ import annotations

import time
from typing import cast

import pytest
from hypothesis import HealthCheck, Phase, settings

from daemon.queue.embedded_redis import EmbeddedRedis
from tests.support.cluster import ClusterServer
from tests.support.scheduler_model import STATS, run_machine

LONG = settings(
    max_examples=600,
    print_blob=True,  # a failure prints the blob that replays it (@reproduce_failure)
    stateful_step_count=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
    # No explain phase: it reruns a failing example at length, after the shrink that says more.
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("server", ["redis_server", "cluster_server"])
def test_stateful_scheduler_keeps_its_invariants_long(server: str, request: pytest.FixtureRequest) -> None:
    """Issue 46: the model's invariants (tests/support/scheduler_model.py) after every step of
    many long random runs of enqueues, claims, ends, cancels, requeues, hand-backs and reclaims
    under every mix of caps, fair share, preemption and retry back-off; on one redis-server and
    on a Redis Cluster."""
    STATS.clear()
    began = time.monotonic()
    run_machine(cast(EmbeddedRedis | ClusterServer, request.getfixturevalue(server)), LONG)
    print(f"stateful: {dict(STATS)} in {time.monotonic() - began:.1f} s")
