"""What runs inside the gpupool job: the submitted call, resumed from the checkpoint an earlier
attempt saved, and checkpointed when the pool stops the job.

submitit's protocol: a callable with a `checkpoint` (or `__submitit_checkpoint__`) method returns,
when asked, a DelayedSubmission that continues the work from where it is. Slurm asks with USR2
before a preemption or the walltime and requeues the job; gpupool asks with the job's stop signal
(SIGTERM) before a requeue, a drain or a preemption (and before a cancel or a timeout, which end
the job all the same), and keeps what the job leaves in `$GPUPOOL_CHECKPOINT_DIR` for its next
attempt (docs/GUARANTEES.md, "Requeue" and "Checkpoints"). So: on the stop signal the checkpoint's
DelayedSubmission is pickled into that directory, and an attempt that finds one there runs it
instead of the submitted one.

This module is pickled by value with each submission (executor.py registers it with cloudpickle),
so the job's environment needs submitit (the DelayedSubmission and the user's Checkpointable are
its classes) but not gpupool: nothing here imports gpupool.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, cast

from submitit.core import plugins, utils
from submitit.core.job_environment import JobEnvironment

# The file in $GPUPOOL_CHECKPOINT_DIR that holds the DelayedSubmission to resume from.
CHECKPOINT_FILE = "submitit_checkpoint.pkl"

# gpupool stops a job with SIGTERM (the job's `--stop-signal`, which the Python API leaves as it
# is), then SIGKILL after its stop grace: the checkpoint must be written within that grace.
STOP_SIGNAL = signal.SIGTERM


class GpupoolJobEnvironment(JobEnvironment):
    """`submitit.JobEnvironment()` inside a gpupool job: its id is the gpupool job's, and it is one
    task on one node (the Python API runs a function as one process)."""

    _env = {"job_id": "GPUPOOL_JOB_ID"}  # noqa: RUF012 (submitit's own class attribute)

    @property
    def num_tasks(self) -> int:
        return 1

    @property
    def num_nodes(self) -> int:
        return 1

    @property
    def node(self) -> int:
        return 0

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0


def run_submission(submitted: utils.DelayedSubmission) -> Any:
    """Run `submitted`, or the checkpoint an earlier attempt of this job saved, and return its
    result; a stop signal while it runs saves its checkpoint, if it has one, and ends the attempt."""
    saved = _checkpoint_path()
    delayed = utils.DelayedSubmission.load(saved) if saved and saved.exists() else submitted
    os.environ["SUBMITIT_EXECUTOR"] = GpupoolJobEnvironment.name()
    # JobEnvironment().paths reads it: the job's files there come back as its artifacts.
    os.environ.setdefault("SUBMITIT_FOLDER", os.environ.get("GPUPOOL_OUTPUT", os.getcwd()))
    _register_environment()
    if saved is None:  # not in a gpupool job: nowhere to keep a checkpoint
        return delayed.result()
    previous = signal.signal(STOP_SIGNAL, _checkpoint_and_exit(delayed, saved))
    try:
        return delayed.result()
    finally:
        signal.signal(STOP_SIGNAL, previous)


def _checkpoint_path() -> Path | None:
    where = os.environ.get("GPUPOOL_CHECKPOINT_DIR")
    return Path(where) / CHECKPOINT_FILE if where else None


def _checkpoint_and_exit(
    delayed: utils.DelayedSubmission, path: Path
) -> Callable[[int, FrameType | None], None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        resume = delayed._checkpoint_function()  # None: not checkpointable, the next attempt starts over
        if resume is not None:
            resume.set_timeout(delayed._timeout_min, delayed._timeout_countdown)
            # Whole or not at all: a save cut short by SIGKILL leaves only the partial file, which
            # the next stop overwrites (submitit's temporary_save_path would refuse to).
            partial = path.with_name(f"{path.name}.partial")
            resume.dump(partial)
            os.replace(partial, path)
        # Then end as the signal would have ended the job without this handler: no outcome is
        # written (an exception raised here would be the call's outcome, raised again in the
        # client), so a job stopped for good (a cancel, a timeout) ends without a result.
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    return handler


def _register_environment() -> None:
    """submitit finds job environments through the "submitit" entry points of what is installed; a
    job whose environment lacks gpupool has none for gpupool, so this adds it to submitit's table
    (a cached dict), where `submitit.JobEnvironment()` looks."""
    known = cast(dict[str, JobEnvironment], plugins.get_job_environments())
    known.setdefault(GpupoolJobEnvironment.name(), GpupoolJobEnvironment())
