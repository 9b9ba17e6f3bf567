"""What one user may put in the pool's Redis with one submission (issue 44 item 6).

Before this, one user with twenty requests added 140 MB to Redis, and their long names broke every
user's listing. A job's spec is bounded in bytes (`job_spec_max_bytes`: its command, environment
and the rest, as stored) and its name in characters (`job_name_max_chars`), and the jobs a user has
queued or running in one queue (`user_max_queued_jobs`) and the bytes a user submits over every
queue within one retention (`user_max_stored_bytes`): the queue keeps those two itself, a batch
judged whole (job_queue.py `enqueue_many`, lib/finish.lua `unended`, lua/store.lua). A refusal says the
bound and the option that sets it.

A job's project (issue 45 item 1) is bounded in bytes too (`project_max_bytes`): poolctl refuses a
larger one before it uploads anything, naming what is big; the server refuses a spec that declares
more, for a poolctl configured otherwise. The bound spares the store and the workers a home
directory sent by mistake; it is no quota (that is the store's).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from daemon.config import Config
from daemon.errors import OverBound, ProjectTooLarge
from daemon.job import JobSpec


@dataclass(frozen=True, slots=True)
class SubmitBounds:
    spec_bytes: int = 64 * 1024
    name_chars: int = 256
    project_bytes: int = 512 * 2**20

    @classmethod
    def of(cls, config: Config) -> SubmitBounds:
        return cls(config.job_spec_max_bytes, config.job_name_max_chars, config.project_max_bytes)

    def check(self, spec: JobSpec) -> None:
        """OverBound when `spec`'s name or its whole is larger than the pool takes."""
        if len(spec.name) > self.name_chars:
            raise OverBound("name", len(spec.name), self.name_chars, "characters", "job_name_max_chars")
        if spec.project is not None and spec.project["size"] > self.project_bytes:
            raise ProjectTooLarge(spec.project["size"], self.project_bytes)
        size = len(msgpack.packb(spec.to_dict()))
        if size > self.spec_bytes:
            raise OverBound("spec", size, self.spec_bytes, "bytes", "job_spec_max_bytes")
