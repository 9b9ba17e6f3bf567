"""What the chaos checker reads and says: the attempts as the jobs wrote them in the ledger (`Span`,
`read_ledger`), and the verdict, a count per rule (`Verdict`), that the tests print and assert.

A ledger line is `job attempt lease worker what microseconds`, and a `start` line goes on with
`key=value` words (tests/chaos/harness.py `job_command`): `array=ID:INDEX`, `gpus=`, `mem=`,
`restored=JOB,LEASE`, '-' for none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Span:
    """One attempt's life as its job wrote it: keyed by its lease id, which never repeats."""

    job: str
    attempt: int
    lease: str
    worker: str
    start: float
    end: float | None = None
    last_seen: float = 0.0  # its last line (a tick, at most TICK apart while it lives)
    stopped: bool = False  # it ended on SIGTERM (handed back: a requeue, a preemption, a drain)
    array: str = ""  # its array's id ($GPUPOOL_ARRAY_ID), "" for none
    gpus: str = ""  # CUDA_VISIBLE_DEVICES, "" for none
    mem: str = ""  # $GPUPOOL_GPU_MEM, "" for none
    restored: str = ""  # whose checkpoint it found at its start, "JOB,LEASE"; "" for none
    estimated: bool = False  # `end` is the checker's bound, not a line the job wrote


@dataclass
class Verdict:
    jobs: int = 0
    lost: int = 0
    rolled_back: int = 0  # ids whose submission Redis lost with its last writes (documented)
    still_running: int = 0  # not ended when the checker stopped waiting, for a reason it names
    unexpected: int = 0
    wrong_ends: int = 0  # ended otherwise than they must (workflow_rules.expected_ends; else succeeded)
    results_not_once: int = 0
    miscounted: int = 0  # queues where a user's count of jobs not ended is not what the records say
    overlaps: int = 0
    guard_kills: int = 0  # attempts killed while running, not by a worker's SIGKILL
    unknown_ends: int = 0
    fifo_violations: int = 0
    reclaimed_jobs: int = 0
    attempts_run: int = 0
    # the workflow rules (tests/chaos/workflow_rules.py)
    dependents: int = 0  # jobs that waited for others
    early_starts: int = 0  # a dependent started before a job it waits for had ended as asked
    unmet_runs: int = 0  # a dependent ran though a job it waits for did not end as asked
    wrong_refusals: int = 0  # a submission refused though what it waits for was in the pool
    arrays: int = 0
    most_under_way: int = 0  # the most jobs of one array running at once, over its window
    window_excess: int = 0  # moments an array ran more of its jobs than its window
    restores: int = 0  # attempts that resumed from a save
    bad_restores: int = 0  # a save of another job, of a later attempt, or of one no history counts
    preempted: int = 0  # attempts of the GPU queue stopped for a job with a priority
    pilot_attempts: int = 0  # attempts that ran on pilots
    gpu_attempts: int = 0  # attempts that ran on (made-up) GPUs
    shared_attempts: int = 0  # of them, --gpu-mem jobs on a shared GPU
    gpu_overcommit: int = 0  # a GPU held whole shared, or shared beyond its memory or job cap
    notified: int = 0  # deliveries owed (job ends x targets)
    hooks_missing: int = 0  # an end owed a delivery that never came
    hook_duplicates: int = 0  # deliveries that came more than once (allowed after a fault)
    hooks_bad: int = 0  # a POST with a bad signature, or that says another end than the job's
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.unexpected
            or self.wrong_ends
            or self.results_not_once
            or self.miscounted
            or self.overlaps
            or self.unknown_ends
            or self.fifo_violations
            or self.early_starts
            or self.unmet_runs
            or self.wrong_refusals
            or self.window_excess
            or self.gpu_overcommit
            or self.bad_restores
            or self.hooks_missing
            or self.hooks_bad
        )


def read_ledger(path: Path) -> dict[str, Span]:
    spans: dict[str, Span] = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) < 6:
            continue
        job, attempt, lease, worker, what, micros = parts[:6]
        at = int(micros) / 1e6
        if what == "start":
            says = dict(word.partition("=")[::2] for word in parts[6:])
            array = says.get("array", "-").rpartition(":")[0]
            spans[lease] = Span(
                job,
                int(attempt),
                lease,
                worker,
                at,
                last_seen=at,
                array="" if array in ("", "-") else array,
                gpus=_some(says.get("gpus")),
                mem=_some(says.get("mem")),
                restored=_some(says.get("restored")),
            )
        elif lease in spans:
            spans[lease].last_seen = at
            if what in {"end", "stopped"}:
                spans[lease].end = at
                spans[lease].stopped = what == "stopped"
    return spans


def _some(value: str | None) -> str:
    return "" if value is None or value == "-" else value
