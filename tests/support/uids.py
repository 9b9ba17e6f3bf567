"""Uids for tests that run processes as uids of their own: a block for each test process.

Every process of a job's uid is the job's (docs/SECURITY.md): a job's end sweeps its uid (kills
every process it has), and a dead worker's orphan guard kills every process of its slots' uids. So
two test processes (pytest-xdist's workers, `make test`) that hand one uid to jobs at once kill
each other's: test_confine's listener, as 61000, died of test_identity's sweep of 61000. Each test
process takes its uids from a block of its own, by its xdist worker's number; workers without a
job_uid_range lease theirs from DEFAULT_UIDS (identity.py), which its lock files keep apart.
"""

from __future__ import annotations

import os

from daemon.worker.identity import DEFAULT_UIDS

# The shipped units' job_uid_ranges (tests/docs/test_operations_guide.py runs workers as them): no
# block overlaps them.
SHIPPED = range(61000, 61128)
BLOCK = 100  # uids each test process may use
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
FIRST = SHIPPED.stop + 72 + BLOCK * _WORKER  # 61200, 61300, ...: this process's first uid

assert DEFAULT_UIDS.start >= FIRST + BLOCK, "more test processes than uid blocks below DEFAULT_UIDS"


def uid(offset: int) -> int:
    """This test process's uid number `offset` (0 <= offset < BLOCK)."""
    assert 0 <= offset < BLOCK, offset
    return FIRST + offset
