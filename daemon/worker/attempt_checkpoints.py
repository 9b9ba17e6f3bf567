"""An attempt's checkpoint at its two ends: the newest earlier save restored before its program
starts, and its last save when it ends, each told in the job's log.

Apart from checkpoints.py, which holds how saves are stored, found and made, and from runner.py,
which decides when: these take what they need of the attempt (its store, lease, directory, log)
and touch none of the run's state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from daemon.errors import JobNotFound, StaleAttempt
from daemon.job import Lease
from daemon.worker import checkpoints, job_data
from daemon.worker.identity import SlotIdentity
from daemon.worker.pool_link import UNREACHABLE, PoolLink
from storage.base import ObjectStore, StorageError

log = logging.getLogger(__name__)


async def restore(
    store: ObjectStore | None,
    queue: PoolLink,
    lease: Lease,
    dest: Path,
    *,
    identity: SlotIdentity | None,
    note: Callable[[str], None],
    lost: Callable[[], bool],
) -> None:
    """A later attempt starts with the newest checkpoint of the newest earlier attempt the
    job's history knows (checkpoints.py), in `dest`, owned by `identity` when it has one; one
    that cannot be fetched fails the start rather than start the job over unsaid. `lost`: whether
    the attempt is no longer this worker's (checkpoints.counted_attempts)."""
    if lease.attempt == 1 or store is None:
        return
    try:
        history, recorded = await checkpoints.counted_attempts(queue, lease, lost)
        restored = await checkpoints.restore(store, lease.job_id, history, recorded, dest)
    except (StorageError, OSError, JobNotFound) as exc:
        raise job_data.DataError(f"cannot restore the job's checkpoint: {exc}") from None
    if restored is not None:
        attempt, n = restored
        by = f" ({attempt.lease})" if attempt.lease else ""
        note(f"checkpoint {n} of attempt {attempt.attempt}{by} restored into $GPUPOOL_CHECKPOINT_DIR")
        if identity is not None:
            await asyncio.to_thread(identity.own_tree, dest)


async def save_last(saver: checkpoints.Saver, lease: Lease, note: Callable[[str], None]) -> None:
    """The attempt's last save (runner.py makes it when another attempt may want it); one that
    fails is told in the job's log and the worker's, and the attempt ends all the same."""
    try:
        if files := await saver.save():
            note(f"checkpoint saved ({files} files)")
    except (StorageError, OSError, StaleAttempt, *UNREACHABLE) as exc:
        note(f"checkpoint not saved: {exc}")
        log.warning("job %s attempt %d: checkpoint not saved (%s)", lease.job_id, lease.attempt, exc)
