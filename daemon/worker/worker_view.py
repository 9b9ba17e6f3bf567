"""What a worker tells others about itself: the view its heartbeat and its metrics take of it.

The heartbeat (heartbeat.py) asks a Worker for its registration (slots taken, GPUs), the leases it
holds and how long it has held none, and gives it the answers by lease (`renewed`); the metrics
scrape asks for the slots and quarantined GPUs as they are now (`sample_metrics`), and the
heartbeat's round trips and the store's bytes are counted as they happen. `service.py` reads
`running` and `idle_for()` (for lifetime.py); the claims and the stop read `draining()`, `_busy()`
and `_runs()`. None of this claims or runs anything:
each answer is read off the books the Worker keeps, so it stands apart from the claiming and the
attempts that change them.

`WorkerView` is that half of `dispatcher.Worker`, a mixin on the Worker's own books (as
stopping.py is), which declares here what of them it uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from daemon.job import Lease, RenewStatus
from daemon.worker.attempt import Phase
from daemon.worker.stopping import Stage

if TYPE_CHECKING:
    from daemon.metrics.worker import WorkerMetrics
    from daemon.queue.registry import Registration
    from daemon.worker.attempt import Holdings
    from daemon.worker.fast_path import LookAhead
    from daemon.worker.gpu_books import GpuBooks
    from daemon.worker.run_types import Run


class WorkerView:
    """The heartbeat's and the metrics' view of a Worker (which sets these attributes)."""

    slots: int
    metrics: WorkerMetrics
    gpu_books: GpuBooks
    _held: Holdings
    _ahead: LookAhead
    _stage: Stage
    _registration: Registration

    def _hand_back(self, leases: Iterable[Lease], deadline: float) -> None:
        raise NotImplementedError  # the Worker's

    # -- metrics ----------------------------------------------------------------------------------

    def _observe_heartbeat(self, round_trip: float | None) -> None:
        if round_trip is None:
            self.metrics.heartbeat_failed()
        else:
            self.metrics.heartbeat(round_trip)

    def _transferred(self, direction: str, nbytes: int) -> None:
        self.metrics.transferred(direction, nbytes)  # the metrics of now: start() replaces them

    async def sample_metrics(self) -> None:
        """Before each scrape: the slots and quarantined GPUs as they are now."""
        self.metrics.set_slots(self._busy(), self.slots)
        self.gpu_books.sample_into(self.metrics)

    # -- heartbeat target -------------------------------------------------------------------------

    def registration(self) -> Registration:
        self._registration.running = self._busy()
        self._registration.gpus = self.gpu_books.describe()
        return self._registration

    def leases(self) -> Sequence[Lease]:
        return [h.lease for h in self._held]

    def idle_for(self) -> float:  # seconds it has held no attempt, 0.0 while it holds one (lifetime.py)
        return self._held.quiet_for()

    def renewed(self, statuses: Mapping[str, RenewStatus], until: float) -> None:
        self._held.renewed(statuses, until)
        if self._ahead:  # cancelled, requeued or preempted before it started: handed back
            stop = (RenewStatus.CANCEL, RenewStatus.REQUEUE, RenewStatus.PREEMPT)
            for held in self._ahead.give_up(i for i, status in statuses.items() if status in stop):
                self._hand_back([held.lease], held.deadline)

    # -- reads ------------------------------------------------------------------------------------

    def _busy(self) -> int:
        """Slots taken: attempts that hold one (from their start until their processes are gone)."""
        return sum(1 for h in self._held if h.slot is not None)

    def _runs(self) -> list[Run]:
        return [h.run for h in self._held if h.run is not None and h.phase is Phase.RUNNING]

    def draining(self) -> bool:
        """True once `stop()` began: no more jobs are claimed."""
        return self._stage is not Stage.WORKING

    @property
    def running(self) -> dict[str, Lease]:
        """The attempts running now, by job id."""
        return {h.lease.job_id: h.lease for h in self._held if h.phase is Phase.RUNNING}
