"""Fair share end to end: a server with a fair-share queue, a real worker running real processes,
two users; the start order and `show`'s reason come out as the rule says."""

from __future__ import annotations

from pathlib import Path

from daemon.queue.embedded_redis import EmbeddedRedis
from protocol import Enqueue, Enqueued, JobDetail, ShowJob
from tests.support.pool import running_pool
from tests.support.workers import running_worker, wait_file, wait_until


async def test_a_light_user_goes_before_a_heavy_one_and_show_says_why(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    starts, go = tmp_path / "starts", tmp_path / "go"

    def job(name: str, wait: bool = False) -> dict[str, object]:
        hold = f"while [ ! -e {go} ]; do sleep 0.02; done; sleep 1; " if wait else ""
        return {"argv": ["sh", "-c", f"echo {name} >> {starts}; {hold}"]}

    async with (
        running_pool(redis_server, tmp_path, fairshare_queues=["default"]) as pool,
        running_worker(pool.queue, tmp_path / "w", slots=1),
    ):
        async with pool.client("alice") as alice:
            await alice.call(Enqueue(job("heavy", wait=True), None), Enqueued)
            await wait_file(starts, 1)  # alice's long job runs, and the only slot is taken
            mine = [(await alice.call(Enqueue(job(f"alice{i}"), None), Enqueued)).job_id for i in range(2)]
        async with pool.client("bob") as bob:
            for i in range(2):
                await bob.call(Enqueue(job(f"bob{i}"), None), Enqueued)
        async with pool.client("alice") as alice:

            async def listed_workers() -> bool:
                return bool(await pool.server.list_workers())

            await wait_until(listed_workers, what="the worker to register")
            reason = (await alice.call(ShowJob(mine[0]), JobDetail)).job["pending_reason"]
        assert reason.startswith("fair share in queue 'default': bob goes first: less recent use (alice: ")
        go.touch()
        # FIFO would run alice's two next; bob, with less recent use (his first job's fraction of
        # a second against alice's second and more), goes first, twice.
        assert await wait_file(starts, 5) == ["heavy", "bob0", "bob1", "alice0", "alice1"]
