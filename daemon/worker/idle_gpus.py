"""A job that holds GPUs and leaves them idle: when it is flagged, and what its queue does then.

An attempt's GPUs are idle at a reading when every one of them was read below `idle_gpu_util`
percent (a GPU whose utilisation cannot be read says nothing, so the attempt is not idle). Idle
for `idle_gpu_minutes` without a break, the job is flagged once: a [gpupool] line in its log,
`idle_gpu` in its record (`poolctl show`, the dashboard, the job-end notification's payload). A
queue named in `idle_gpu_requeue_queues` or `idle_gpu_cancel_queues` then acts after a grace
(`idle_gpu_grace_minutes` more, still idle without a break): the job is handed back to the front
of its queue, or cancelled. Busy again before that, the clock starts over; the flag stays, as a
record of what was seen.

The decision is this file's alone (one policy, one verdict); the worker applies it
(dispatcher.py) at each reading of its GPUs (gpu_readings.py).
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from daemon.config import Config


class Act(enum.Enum):
    FLAG = "flag"  # idle for idle_gpu_minutes: say so
    REQUEUE = "requeue"  # and for the grace after it, on a queue that asks: hand it back
    CANCEL = "cancel"  # or cancel it


@dataclass(frozen=True, slots=True)
class IdlePolicy:
    """The pool's idle-GPU settings (config: idle_gpu_*)."""

    util: float = 5.0  # percent: below it on every GPU the attempt holds, the reading is idle
    minutes: float = 30.0  # idle this long: flagged (0: never)
    grace_minutes: float = 30.0  # idle this much longer: its queue's policy, if any, acts
    requeue_queues: Collection[str] = ()
    cancel_queues: Collection[str] = ()

    @classmethod
    def of(cls, config: Config) -> IdlePolicy:
        return cls(
            util=config.idle_gpu_util,
            minutes=config.idle_gpu_minutes,
            grace_minutes=config.idle_gpu_grace_minutes,
            requeue_queues=frozenset(config.idle_gpu_requeue_queues),
            cancel_queues=frozenset(config.idle_gpu_cancel_queues),
        )

    def action(self, queue: str) -> Act | None:
        """What `queue` asks for after the grace; None: a flag only."""
        if queue in self.cancel_queues:
            return Act.CANCEL
        if queue in self.requeue_queues:
            return Act.REQUEUE
        return None

    def watch(self, queue: str) -> IdleWatch | None:
        """A watch for an attempt of `queue`; None when flagging is off."""
        return IdleWatch(self, self.action(queue)) if self.minutes > 0 else None


class IdleWatch:
    """One attempt's idle clock: `observe` each reading of its GPUs; it answers FLAG once, then
    the queue's act once, each when due."""

    def __init__(self, policy: IdlePolicy, action: Act | None) -> None:
        self.policy = policy
        self.action = action
        self.since: float | None = None  # time.time() of the first idle reading of this stretch
        self.flagged = False
        self.acted = False

    def observe(self, utils: Sequence[float | None], at: float) -> Act | None:
        """`utils`: the attempt's GPUs' utilisation (0-1) at `at`, one each."""
        if not utils or any(u is None or u * 100 >= self.policy.util for u in utils):
            self.since = None
            return None
        if self.since is None:
            self.since = at
        idle = at - self.since
        if not self.flagged and idle >= self.policy.minutes * 60:
            self.flagged = True
            return Act.FLAG
        due = (self.policy.minutes + self.policy.grace_minutes) * 60
        if self.flagged and self.action is not None and not self.acted and idle >= due:
            self.acted = True
            return self.action
        return None

    def idle_minutes(self, at: float) -> float:
        return 0.0 if self.since is None else (at - self.since) / 60
