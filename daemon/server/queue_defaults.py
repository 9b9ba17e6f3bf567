"""The CPUs and memory a job gets in its queue when it asks for none (issue 50): the server fills
them into its spec at enqueue (`queue_default_cpus`, `queue_default_mem`), so the scheduler, the
worker's cgroup and `poolctl show` all see what it runs with. A job that asks (`--cpus`, `--mem`)
keeps its own. Not in a queue a worker of before issue 50 still serves: it would fail a spec with
either (admission.py `_resources` gives none there)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from daemon.config import Config
from daemon.job import JobSpec
from daemon.option_values import queue_cpus, queue_mem


@dataclass(frozen=True, slots=True)
class QueueDefaults:
    cpus: Mapping[str, int] = field(default_factory=dict)  # queue -> CPUs
    mem: Mapping[str, int] = field(default_factory=dict)  # queue -> bytes

    @classmethod
    def of(cls, config: Config) -> QueueDefaults:
        return cls(queue_cpus(config.queue_default_cpus), queue_mem(config.queue_default_mem))

    def applied(self, spec: JobSpec) -> JobSpec:
        """`spec`, with its queue's defaults where it asks for no CPUs or memory."""
        cpus = spec.cpus or self.cpus.get(spec.queue, 0)
        mem = spec.mem or self.mem.get(spec.queue, 0)
        if (cpus, mem) == (spec.cpus, spec.mem):
            return spec
        return dataclasses.replace(spec, cpus=cpus, mem=mem)
