"""The sums `poolctl acct` is made of (issue 50, accounting), without a pool: the wait quantiles'
sketch against the exact values, and the sums of records as lib/account.lua lays them out."""

from __future__ import annotations

import math
import random

import pytest

from daemon.server.accounting import Quantiles, Totals


def exact(values: list[float], q: float) -> float:
    return sorted(values)[max(1, math.ceil(q * len(values))) - 1]


@pytest.mark.parametrize("seed", range(3))
def test_wait_quantiles_are_within_one_percent_of_the_exact_ones_at_a_fixed_size(seed: int) -> None:
    """issue 50, accounting: p50 and p90 of 20 000 waits spread from 0 to days come within 1 % of
    the exact nearest-rank values, zeros included, while the sketch holds at most a bucket per
    1 % of range: bounded, however many jobs a year holds."""
    rng = random.Random(seed)
    waits = [0.0] * 500 + [rng.lognormvariate(3, 3) for _ in range(20_000)]
    sketch = Quantiles()
    for w in waits:
        sketch.add(w)
    for q in (0.5, 0.9, 0.01, 1.0):
        assert sketch.quantile(q) == pytest.approx(exact(waits, q), rel=0.01)
    assert len(sketch.buckets) < 3000
    assert Quantiles().quantile(0.5) is None


def test_totals_count_failures_efficiency_and_waits_from_the_records_fields() -> None:
    """issue 50, accounting: failed and dead jobs are failures, cancelled ones counted apart;
    efficiency weighs each measured job's utilisation by its GPU-ms and leaves out the jobs
    without a measure (and those without GPUs); a job that never ran has no wait."""
    t = Totals()
    t.add(b"s", b"1000", b"3600000", b"0", b"80")  # an hour of one GPU at 80 %
    t.add(b"f", b"3000", b"10800000", b"7200000", b"20")  # three GPU-hours at 20 %
    t.add(b"d", b"2000", b"3600000", b"0", b"-")  # not measured
    t.add(b"c", b"-", b"0", b"0", b"-")  # cancelled while queued
    t.add(b"s", b"0", b"0", b"0", b"0")  # a CPU job: no GPU time to weigh
    row = t.row()
    assert (row["jobs"], row["failed"], row["cancelled"]) == (5, 2, 1)
    assert row["gpu_hours"] == pytest.approx(5.0)
    assert row["cpu_hours"] == pytest.approx(2.0)
    assert row["efficiency"] == pytest.approx((1 * 0.8 + 3 * 0.2) / 4)
    assert row["wait_p50"] == pytest.approx(1.0, rel=0.01)
    assert row["wait_p90"] == pytest.approx(3.0, rel=0.01)
