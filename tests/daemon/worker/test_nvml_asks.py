"""nvml_asks.py: one bounded ask pending per GPU, shared by the worker's askers (a health pass, a
job's end check), each ask a real daemon thread running a call that blocks as NVML's may."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from daemon.worker.gpus import GpuAllocator, recheck_quarantine
from daemon.worker.nvml_asks import GpuAsks
from tests.support.workers import fake_gpus

WAIT = 10.0


def answers(value: str, gate: threading.Event | None = None) -> str:
    """A call that answers `value`, once `gate` is open (None: at once): an NVML read of a GPU
    that answers at once, or one held by its driver until then."""
    if gate is not None:
        gate.wait(WAIT)
    return value


async def test_two_askers_sharing_a_pending_ask_both_get_their_answers() -> None:
    """A pass asked GPUs X (quick) and Y (slow: a driver lock) and waited; meanwhile a job's end
    check asked X, took the pass's answer for it, and dropped it from the pending asks: the pass,
    resuming, failed on dropping it again (KeyError), and the health watch's task died with it
    (review of the shared asks). Each asker now takes its answers, whoever took them first."""
    asks: GpuAsks[str] = GpuAsks("test-asks")
    slow = threading.Event()
    passing = asyncio.ensure_future(
        asks.ask({"X": lambda: answers("x"), "Y": lambda: answers("y", slow)}, 3.0)
    )
    await asyncio.sleep(0.2)  # the pass waits on Y; X has answered
    checked = await asks.ask({"X": lambda: answers("x again")}, 3.0)
    assert checked["X"].answer.result() == "x"  # the pass's ask, answered: taken, not asked again
    slow.set()
    got = await asyncio.wait_for(passing, WAIT)
    assert {uuid: ask.answer.result() for uuid, ask in got.items()} == {"X": "x", "Y": "y"}
    again = await asks.ask({"X": lambda: answers("x fresh"), "Y": lambda: answers("y fresh")}, 3.0)
    assert {uuid: ask.answer.result() for uuid, ask in again.items()} == {"X": "x fresh", "Y": "y fresh"}


async def test_an_asker_may_wait_for_an_ask_another_made() -> None:
    """A job's end check, its GPU's read already asked by a pass a moment before and held by the
    driver a few seconds (the dying job's context torn down), took it as unanswered at once and
    judged from the book alone: the job ended FAILED though the read, a moment later, showed the
    fault (review of the shared asks). `wait_pending` waits for such an ask within the bound."""
    asks: GpuAsks[str] = GpuAsks("test-asks")
    held = threading.Event()
    passing = asyncio.ensure_future(asks.ask({"X": lambda: answers("ecc", held)}, 0.1))
    await asyncio.sleep(0.3)  # the pass has given up waiting; its ask is still pending
    loop = asyncio.get_running_loop()
    loop.call_later(0.5, held.set)  # the driver lets go
    checked = await asks.ask({"X": lambda: answers("never asked")}, 3.0, wait_pending=True)
    assert checked["X"].answer.done()
    assert checked["X"].answer.result() == "ecc"
    await asyncio.wait_for(passing, WAIT)


async def test_a_quarantine_check_on_a_gpu_whose_ask_is_pending_says_nothing_of_nvml(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A final review's finding 2: a quarantine check that found its GPU's ask pending, asked by
    a check a moment before (the asks are shared: two jobs ending together), logged "stays
    quarantined: NVML does not answer for it" at once, of a GPU whose NVML had not yet had
    a second to answer. It says so only once the ask has hung (nvml_asks.HUNG_SECONDS)."""
    gpus = fake_gpus(1)
    allocator = GpuAllocator(gpus, slots=1)
    allocator.quarantine(gpus[0].uuid, "after job default.x: processes [7] hold memory")
    held = threading.Event()

    class HeldByItsDriver:  # NVML's compute processes of a GPU whose driver lock is held a moment
        def compute_pids(self, uuid: str) -> set[int]:
            held.wait(WAIT)
            return set()

    asks: GpuAsks[set[int]] = GpuAsks("test-asks")
    first = asyncio.ensure_future(recheck_quarantine(allocator, HeldByItsDriver(), asks))
    await asyncio.sleep(0.2)  # the first check waits on its ask
    with caplog.at_level(logging.WARNING, logger="daemon.worker.gpus"):
        assert await recheck_quarantine(allocator, HeldByItsDriver(), asks) is False  # pending
        held.set()  # the driver lets go: the first check's ask answers
        assert await asyncio.wait_for(first, WAIT) is True
    assert allocator.quarantined == {}
    assert [r.getMessage() for r in caplog.records if "NVML does not answer" in r.getMessage()] == []
