"""What one user may put in the pool's Redis with one submission (issue 44 item 6).

Before this, one user with twenty requests added 140 MB to Redis, and their long names broke every
user's listing. A job's spec is bounded in bytes (`job_spec_max_bytes`: its command, environment
and the rest, as stored) and its name in characters (`job_name_max_chars`), and the jobs a user has
queued or running in one queue (`user_max_queued_jobs`): the enqueue scripts keep that bound
themselves, atomically (_lib.lua `unended`); `check_room` reads the same counts first, so that a
batch over the bound is refused whole before any of it is written, as the scripts would refuse
only the chunk that passed it. A refusal says the bound and the option that sets it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from daemon.config import Config
from daemon.errors import OverBound, TooManyUnended
from daemon.job import JobSpec
from daemon.queue.job_queue import JobQueue


@dataclass(frozen=True, slots=True)
class SubmitBounds:
    spec_bytes: int = 64 * 1024
    name_chars: int = 256

    @classmethod
    def of(cls, config: Config) -> SubmitBounds:
        return cls(config.job_spec_max_bytes, config.job_name_max_chars)

    def check(self, spec: JobSpec) -> None:
        """OverBound when `spec`'s name or its whole is larger than the pool takes."""
        if len(spec.name) > self.name_chars:
            raise OverBound("name", len(spec.name), self.name_chars, "characters", "job_name_max_chars")
        size = len(msgpack.packb(spec.to_dict()))
        if size > self.spec_bytes:
            raise OverBound("spec", size, self.spec_bytes, "bytes", "job_spec_max_bytes")


async def check_room(queue: JobQueue, specs: Sequence[JobSpec], user: str) -> None:
    """TooManyUnended when `specs` would take `user` past `queue.max_unended` jobs queued or
    running in one of their queues: the whole submission is refused before any of it is written."""
    if not queue.max_unended:
        return
    adding = Counter(s.queue for s in specs)
    has = await queue.unended(user, sorted(adding))
    for q, n in adding.items():
        if has[q] + n > queue.max_unended:
            raise TooManyUnended(user, q, has[q], n, queue.max_unended)
