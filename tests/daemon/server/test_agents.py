"""Agent workers, the server's side (issue 44 item 1): an agent holds only its user's token; the
server runs a worker for it (worker/hosted.py) that makes every fenced write, serves it only its
user's jobs, and signs store URLs for one attempt's own keys.

Real server, real Redis (and a real S3 for the store's signatures); the agent is scripted: a
PoolClient, the server's own client, that sends serve_jobs and answers its orders by hand, as
docs/PROTOCOL.md §3.4 says an agent does."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from daemon.client.pool_client import ClientError, PoolClient
from daemon.job import JobSpec, JobState
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.job_queue import JobQueue
from daemon.server import agents
from daemon.spec_checks import project_id
from daemon.worker import hosted
from daemon.worker.hosted import hosted_worker
from protocol import (
    AgentAnswer,
    AgentCall,
    AgentOrder,
    CancelJobs,
    Cancelled,
    Enqueue,
    Enqueued,
    ErrorCode,
    Served,
    ServeJobs,
    Waited,
    WaitJobs,
)
from storage.content import content_key
from tests.support.pool import Pool, fresh_bucket, running_pool
from tests.support.s3server import S3Server

LEASE = 2.0  # worker_healthy_response_period: a dropped agent's lease lapses this soon
WAIT = 10.0  # the longest any one step may take
DRAIN = 0.5  # drain_timeout: how long a stopping worker lets its jobs run before it hands them back
SUCCEEDED = {"state": "succeeded", "exit_code": 0, "detail": "", "result": {}}


class ScriptedAgent:
    """An agent by hand: `serve_jobs` on its own connection, its orders read into a queue, and a
    `beat` every beat_seconds (the hello's) until `silence()`, as an agent that froze."""

    def __init__(
        self, pool: Pool, user: str, host: str = "node-a", slots: int = 1, shared_uid: bool = False
    ) -> None:
        self.client = pool.client(user)
        self.offer = ServeJobs(
            slots, ["default"], [], 0.0, host, shared_uid, {"batch_job": "slurm:7"}, 600.0, 60.0
        )
        self.orders: asyncio.Queue[AgentOrder | Served | ClientError] = asyncio.Queue()
        self.worker = ""
        self.key = b""
        self._reader: asyncio.Task[None] | None = None
        self._beats: asyncio.Task[None] | None = None

    async def __aenter__(self) -> ScriptedAgent:
        await self.client.connect()
        self._reader = asyncio.create_task(self._read())
        hello = await self.next("hello")
        self.worker, self.key = hello.detail["worker"], hello.detail["key"]
        self._beats = asyncio.create_task(self._beat(float(hello.detail.get("beat_seconds", 0.5))))
        return self

    async def _beat(self, every: float) -> None:
        while True:
            with contextlib.suppress(ClientError):
                await self.call("", "beat")
            await asyncio.sleep(every)

    async def silence(self) -> None:
        """No more beats; the connection stays up (a frozen agent: the kernel keeps TCP)."""
        if self._beats is not None:
            self._beats.cancel()
            await asyncio.gather(self._beats, return_exceptions=True)

    async def __aexit__(self, *exc: object) -> None:
        await self.drop()

    async def drop(self) -> None:
        """The agent's connection ends (as when its machine dies)."""
        await self.silence()
        await self.client.close()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)

    async def _read(self) -> None:
        try:
            async for item in self.client.stream(self.offer):
                assert isinstance(item, AgentOrder | Served), item
                self.orders.put_nowait(item)
        except ClientError as exc:
            self.orders.put_nowait(exc)

    async def next(self, act: str) -> AgentOrder:
        """The next order; it must be `act`."""
        async with asyncio.timeout(WAIT):
            order = await self.orders.get()
        assert isinstance(order, AgentOrder), order
        assert order.act == act, order
        return order

    async def served(self) -> Served:
        """The stream's end."""
        async with asyncio.timeout(WAIT):
            item = await self.orders.get()
        assert isinstance(item, Served), item
        return item

    async def call(
        self, lease_id: str, call: str, args: dict[str, Any] | None = None, **kw: Any
    ) -> dict[str, Any]:
        """An agent_call; `key` and `client` (another connection) replace the agent's own."""
        key = kw.get("key", self.key)
        request = AgentCall(self.worker, key, lease_id, call, args or {})
        client: PoolClient = kw.get("client", self.client)
        return (await client.call(request, AgentAnswer)).value

    async def run_to_success(self, run: AgentOrder, output: bytes = b"") -> None:
        """What an agent does for a job that exits 0: its output, its end, its slot tidied."""
        await self.call(run.lease_id, "exited")
        if output:
            await self.call(run.lease_id, "append_log", {"number": 1, "chunks": [output]})
        await self.call(run.lease_id, "ended", {"ending": "exited", "outcome": SUCCEEDED, "dirty_gpus": {}})
        await self.next("tidy")
        await self.call(run.lease_id, "tidied")


@pytest.fixture
async def pool(redis_server: EmbeddedRedis, tmp_path: Path) -> AsyncIterator[Pool]:
    async with running_pool(
        redis_server,
        tmp_path,
        users=("alice", "bob", "root"),
        admins=("root",),
        agent_workers=hosted_worker,
        worker_healthy_response_period=LEASE,
        drain_timeout=DRAIN,
    ) as p:
        yield p


async def enqueue(pool: Pool, user: str, **spec: Any) -> str:
    async with pool.client(user) as c:
        return (await c.call(Enqueue({"argv": ["train"], **spec}, None), Enqueued)).job_id


async def wait_for(pool: Pool, job_id: str) -> dict[str, Any]:
    async with pool.client("root") as c:
        waited = await c.call(WaitJobs([job_id], WAIT), Waited)
    assert not waited.timed_out
    return waited.jobs[0]


def connections_held(pool: Pool) -> int:
    """Connections of the server's Redis client taken from its pool now (redis-py's books)."""
    return len(pool.queue.redis.connection_pool._in_use_connections)  # type: ignore[union-attr]


async def refused(call: Any, code: ErrorCode = ErrorCode.PERMISSION_DENIED) -> str:
    with pytest.raises(ClientError) as err:
        await call
    assert err.value.code == code, err.value
    return err.value.message


async def test_alices_job_is_ordered_to_her_agent_and_recorded_by_the_server(pool: Pool) -> None:
    """issue 44 item 1: a job enqueued by alice is ordered to alice's agent, renewed for it, and
    once it has exited, ended (exit 0) and been tidied it is SUCCEEDED, its output in its log:
    every write made by the server's worker for the agent, which holds only alice's token."""
    job_id = await enqueue(pool, "alice")
    async with ScriptedAgent(pool, "alice") as agent:
        run = await agent.next("run")
        assert run.detail["lease"]["job_id"] == job_id
        assert run.detail["lease"]["spec"]["argv"] == ["train"]
        assert 0 < run.detail["valid_for"] <= LEASE
        beat = await agent.call("", "beat")  # the lease's news, counted from the beat's arrival
        assert 0 < beat["valid_for"][run.lease_id] <= LEASE
        workers = {w["id"]: w for w in await pool.server.list_workers()}
        assert workers[agent.worker]["host"] == "node-a"
        assert workers[agent.worker]["batch_job"] == "slurm:7"
        assert workers[agent.worker]["serves"] == "alice"
        await agent.run_to_success(run, b"epoch 1: loss 0.3\n")
        job = await wait_for(pool, job_id)
        assert job["state"] == JobState.SUCCEEDED, job
        assert job["worker"] == agent.worker
        assert b"".join(d for _, d in await pool.queue.read_log(job_id)) == b"epoch 1: loss 0.3\n"


async def test_bobs_job_is_passed_over_by_alices_agent_and_run_by_an_admins(pool: Pool) -> None:
    """issue 44 item 1: alice's agent is never ordered bob's job, though it heads the queue: it
    is given alice's, queued after it. An admin's agent serves everyone's, bob's included, unless
    its jobs run as its own uid (`shared_uid`), where every job could read the admin's token."""
    bobs = await enqueue(pool, "bob")
    alices = await enqueue(pool, "alice")
    async with ScriptedAgent(pool, "alice", slots=2) as agent:
        run = await agent.next("run")
        assert run.detail["lease"]["job_id"] == alices
        await agent.run_to_success(run)
        with pytest.raises(TimeoutError):  # a slot free, bob's job queued: still never ordered
            async with asyncio.timeout(1.0):
                await agent.next("run")
        assert (await pool.queue.get(bobs)).state is JobState.QUEUED
        async with ScriptedAgent(pool, "root", host="node-b", shared_uid=True) as own_uid:
            with pytest.raises(TimeoutError):  # bob's job would read root's token there
                async with asyncio.timeout(1.0):
                    await own_uid.next("run")
        assert (await pool.queue.get(bobs)).state is JobState.QUEUED
        async with ScriptedAgent(pool, "root", host="node-b") as admins:
            run = await admins.next("run")
            assert run.detail["lease"]["job_id"] == bobs
            await admins.run_to_success(run)
            assert (await wait_for(pool, bobs))["state"] == JobState.SUCCEEDED


async def test_a_cancelled_job_is_ordered_stopped_and_its_lease_still_renewed(pool: Pool) -> None:
    """issue 44 item 1: alice cancels her job while her agent runs it: the agent is ordered to
    cancel it, and told its lease holds on while it stops (its SIGTERM grace may outlast a lease's
    renewal period), and the end it reports is recorded: CANCELLED."""
    job_id = await enqueue(pool, "alice")
    async with ScriptedAgent(pool, "alice") as agent:
        run = await agent.next("run")
        async with pool.client("alice") as alice:
            assert (await alice.call(CancelJobs([job_id]), Cancelled)).states[job_id] == "cancelling"
        await agent.next("cancel")
        await asyncio.sleep(LEASE)  # renewed meanwhile, while it stops
        beat = await agent.call("", "beat")
        assert 0 < beat["valid_for"][run.lease_id] <= LEASE
        cancelled = {"state": "cancelled", "exit_code": 143, "detail": "cancelled", "result": {}}
        await agent.call(
            run.lease_id, "ended", {"ending": "cancelled", "outcome": cancelled, "dirty_gpus": {}}
        )
        assert (await wait_for(pool, job_id))["state"] == JobState.CANCELLED


async def test_a_wrong_key_or_an_attempt_not_held_is_refused_and_writes_nothing(pool: Pool) -> None:
    """issue 44 item 1: a call with another key, from another user's connection (with the right
    key), or for an attempt the worker does not run (made up, or ended), is PERMISSION_DENIED,
    and nothing of it is written: not the log, not the outcome."""
    job_id = await enqueue(pool, "alice")
    async with ScriptedAgent(pool, "alice") as agent, pool.client("bob") as bob:
        run = await agent.next("run")
        log = {"number": 1, "chunks": [b"forged\n"]}
        await refused(agent.call(run.lease_id, "append_log", log, key=secrets.token_bytes(32)))
        await refused(agent.call(run.lease_id, "ended", {"ending": "exited", "outcome": SUCCEEDED}, key=b""))
        message = await refused(agent.call(run.lease_id, "append_log", log, client=bob))
        assert "no agent of bob" in message
        await refused(agent.call(f"{agent.worker}/99.0", "append_log", log))
        await refused(agent.call(run.lease_id, "tidied"))  # no tidy ordered yet
        assert await pool.queue.read_log(job_id) == []
        assert (await pool.queue.get(job_id)).state is JobState.RUNNING
        await agent.run_to_success(run)
        await refused(agent.call(run.lease_id, "append_log", {"number": 2, "chunks": [b"late\n"]}))
        assert (await wait_for(pool, job_id))["state"] == JobState.SUCCEEDED
        assert await pool.queue.read_log(job_id) == []


async def test_an_agent_whose_connection_drops_leaves_its_lease_to_lapse(pool: Pool) -> None:
    """issue 44 item 1: when an agent's connection ends, its worker stops at once and hands
    nothing back: the attempt's lease lapses, the reaper reclaims the job, and it runs again,
    attempt 2, on another agent."""
    job_id = await enqueue(pool, "alice")
    first = ScriptedAgent(pool, "alice", host="node-a")
    await first.__aenter__()
    run = await first.next("run")
    await first.drop()
    job = await pool.queue.get(job_id)
    assert job.state is JobState.RUNNING  # not handed back: left to lapse
    assert job.attempt == 1
    async with ScriptedAgent(pool, "alice", host="node-b") as second:
        again = await second.next("run")
        assert again.detail["lease"]["job_id"] == job_id
        assert again.detail["lease"]["attempt"] == 2
        assert again.lease_id != run.lease_id
        await second.run_to_success(again)
        job_record = await wait_for(pool, job_id)
    assert job_record["state"] == JobState.SUCCEEDED
    assert [a["how"] for a in job_record["attempts"]] == ["lost", "succeeded"]


async def test_an_agent_that_stops_beating_has_its_job_reclaimed_and_run_elsewhere(pool: Pool) -> None:
    """issue 44 item 1: an agent that stops beating but keeps its connection up (frozen: SIGSTOP,
    a Slurm suspend; or a partition TCP has not noticed) is abandoned by its worker within a
    lease: the worker leaves the registry, renews nothing more, and the job's lease lapses, so
    it runs again, attempt 2, on an agent that beats; while an agent that beats keeps its job."""
    kept = await enqueue(pool, "bob")
    job_id = await enqueue(pool, "alice")
    async with ScriptedAgent(pool, "bob", host="node-c") as beating, ScriptedAgent(pool, "alice") as frozen:
        mine = await beating.next("run")
        run = await frozen.next("run")
        await frozen.silence()
        async with ScriptedAgent(pool, "alice", host="node-b") as second:
            again = await second.next("run")  # (WAIT is five leases)
            assert again.detail["lease"]["job_id"] == job_id
            assert again.detail["lease"]["attempt"] == 2
            assert again.lease_id != run.lease_id
            workers = {w["id"] for w in await pool.server.list_workers()}
            assert frozen.worker not in workers
            assert {second.worker, beating.worker} <= workers
            assert "no beat" in (await frozen.served()).reason
            await second.run_to_success(again)
            job = await wait_for(pool, job_id)
        assert [a["how"] for a in job["attempts"]] == ["lost", "succeeded"]
        held = await pool.queue.get(kept)
        assert held.state is JobState.RUNNING
        assert held.attempt == 1
        await beating.run_to_success(mine)
        assert (await wait_for(pool, kept))["state"] == JobState.SUCCEEDED


async def test_a_tidy_that_goes_unanswered_does_not_hold_the_workers_stop(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 44 item 1: an agent that beats but never says `tidied` does not hold its worker for
    ever: after its kill grace plus TIDY_SLACK the server's worker takes the slot as ready, so its
    stop (the agent's drain) ends, with `served`."""
    monkeypatch.setattr(hosted, "TIDY_SLACK", 0.5)
    await enqueue(pool, "alice")
    agent = ScriptedAgent(pool, "alice")
    agent.offer = ServeJobs(1, ["default"], [], 0.0, "node-a", False, {}, 600.0, 0.5)  # kill_grace 0.5
    async with agent:
        run = await agent.next("run")
        await agent.call(run.lease_id, "exited")
        await agent.call(run.lease_id, "ended", {"ending": "exited", "outcome": SUCCEEDED, "dirty_gpus": {}})
        await agent.next("tidy")  # and never a `tidied`
        await agent.call("", "drain", {"now": True})
        assert "drained" in (await agent.served()).reason


async def http_put(url: str, data: bytes, sha256: str) -> None:
    headers = {"x-amz-meta-sha256": sha256, "Content-Length": str(len(data))}
    async with aiohttp.ClientSession() as s, s.put(url, data=data, headers=headers) as r:
        assert r.status < 300, await r.text()


@pytest.fixture
async def s3_pool(redis_server: EmbeddedRedis, tmp_path: Path, s3_server: S3Server) -> AsyncIterator[Pool]:
    async with running_pool(
        redis_server,
        tmp_path,
        store=await fresh_bucket(s3_server),
        users=("alice", "bob"),
        agent_workers=hosted_worker,
        worker_healthy_response_period=LEASE,
    ) as p:
        yield p


async def test_an_attempts_store_urls_reach_its_own_keys_only(s3_pool: Pool) -> None:
    """issue 44 item 1: an agent's attempt is signed a GET of its own input and of its project's
    packs (issue 45 item 1), and a PUT under its own artifacts; a PUT outside its attempt's prefix
    (another attempt's, another job's, a content key) and a GET of another job's input are
    PERMISSION_DENIED."""
    store = s3_pool.server.store
    mine, theirs, pack = b"alice's dataset", b"bob's dataset", b"alice's project, packed"
    keys = {}
    for data in (mine, theirs, pack):
        sha = hashlib.sha256(data).hexdigest()
        keys[data] = content_key(sha)
        await store.put_bytes(keys[data], data)

    def spec(data: bytes, **more: object) -> JobSpec:
        inputs = [{"sha256": hashlib.sha256(data).hexdigest(), "dest": "d", "kind": "file"}]
        return JobSpec.from_dict({"argv": ["train"], "inputs": inputs, **more})

    packs = [hashlib.sha256(pack).hexdigest()]
    project = {"id": project_id(packs), "packs": packs, "dir": "", "commit": "", "dirty": True}
    job_id, _ = await s3_pool.queue.enqueue(
        spec(mine, user="alice", project=project | {"files": 1, "size": 23})
    )
    bobs_job, _ = await s3_pool.queue.enqueue(spec(theirs, user="bob", queue="other"))
    async with ScriptedAgent(s3_pool, "alice") as agent:
        run = await agent.next("run")
        assert run.detail["lease"]["job_id"] == job_id
        for data in (mine, pack):
            got = await agent.call(run.lease_id, "store_get", {"key": keys[data]})
            async with aiohttp.ClientSession() as http, http.get(got["url"]) as r:
                assert await r.read() == data
        await refused(agent.call(run.lease_id, "store_get", {"key": keys[theirs]}))
        await refused(agent.call(run.lease_id, "store_get", {"key": f"checkpoints/{bobs_job}/x.1.done"}))
        sha = hashlib.sha256(b"weights").hexdigest()
        own = f"artifacts/{job_id}/{run.lease_id.replace('/', '%2F')}/out/model.pt"
        put = await agent.call(run.lease_id, "store_put", {"key": own, "size": 7, "sha256": sha})
        await http_put(put["url"], b"weights", sha)
        assert (await store.head(own)).sha256 == sha
        for key in (
            f"artifacts/{job_id}/1/out/model.pt",  # another attempt's names
            f"artifacts/{bobs_job}/{run.lease_id.replace('/', '%2F')}/out/model.pt",
            f"checkpoints/{job_id}/1.1.done",
            keys[mine],
        ):
            await refused(agent.call(run.lease_id, "store_put", {"key": key, "size": 7, "sha256": sha}))
        climbing = f"artifacts/{job_id}/{run.lease_id.replace('/', '%2F')}/../../{bobs_job}/x"
        await refused(
            agent.call(run.lease_id, "store_put", {"key": climbing, "size": 7, "sha256": sha}),
            ErrorCode.INVALID_ARGUMENT,
        )
        await agent.run_to_success(run)


async def test_a_drained_agent_hands_its_job_back_and_is_served(pool: Pool) -> None:
    """issue 44 item 1: the agent's `drain` (its SIGTERM) stops its worker as a worker stops:
    the job it runs is ordered handed back, goes back to its queue, and the stream ends with
    `served` once the worker has stopped, holding none of the server's Redis connections."""
    job_id = await enqueue(pool, "alice")
    held = connections_held(pool)
    async with ScriptedAgent(pool, "alice") as agent:
        run = await agent.next("run")
        await agent.call("", "drain", {"now": True})
        stop = await agent.next("hand_back")
        assert stop.lease_id == run.lease_id
        assert stop.detail["now"] is True
        await agent.call(run.lease_id, "ended", {"ending": "handed back", "outcome": None, "dirty_gpus": {}})
        await agent.next("tidy")
        await agent.call(run.lease_id, "tidied")
        assert "drained" in (await agent.served()).reason
        assert connections_held(pool) == held  # none kept for a worker that is gone
    job = await pool.queue.get(job_id)
    assert job.state is JobState.QUEUED
    assert [a.how for a in job.attempts] == ["released"]


async def test_the_server_stops_its_agents_as_workers_and_bounds_them(
    pool: Pool, queue: JobQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 44 item 1: an agent offers at most MAX_AGENT_SLOTS slots, a user runs at most
    MAX_AGENTS_PER_USER agents (an admin is not bounded so), and no agent is served that must
    leave (leave_by) before it could drain, each refusal a sentence; and at the server's stop each
    agent's job is ordered handed back and its stream ends with `served`."""
    monkeypatch.setattr(agents, "MAX_AGENTS_PER_USER", 1)
    async with pool.client("alice") as alice:
        too_many = ServeJobs(
            agents.MAX_AGENT_SLOTS + 1, ["default"], [], 0.0, "node-a", False, {}, 60.0, 10.0
        )
        message = await refused(alice.call(too_many, Served), ErrorCode.INVALID_ARGUMENT)
        assert f"1 to {agents.MAX_AGENT_SLOTS} slots" in message
        # a pilot at its end: the server's timings, shorter than its own, leave it no time to work
        leaving = ServeJobs(1, ["default"], [], time.time() + DRAIN, "node-a", False, {}, 600.0, 60.0)
        message = await refused(alice.call(leaving, Served), ErrorCode.INVALID_ARGUMENT)
        assert "takes" in message
        assert "to leave" in message
    job_id = await enqueue(pool, "alice")
    async with contextlib.AsyncExitStack() as agents_up:
        agent = await agents_up.enter_async_context(ScriptedAgent(pool, "alice"))
        async with pool.client("alice") as alice:
            message = await refused(alice.call(agent.offer, Served), ErrorCode.RESOURCE_EXHAUSTED)
        assert "alice already has 1 agents" in message
        run = await agent.next("run")
        # offered after: an admin's agent serves everyone's jobs, and the one job is `agent`'s
        admins = await agents_up.enter_async_context(ScriptedAgent(pool, "root", host="node-b"))
        stopping = asyncio.create_task(pool.server.stop())
        await agent.next("hand_back")
        await agent.call(run.lease_id, "ended", {"ending": "handed back", "outcome": None, "dirty_gpus": {}})
        await agent.next("tidy")
        await agent.call(run.lease_id, "tidied")
        for each in (agent, admins):
            assert "the server is stopping" in (await each.served()).reason
    async with asyncio.timeout(WAIT):  # (the agents' connections closed, as agents close them)
        await stopping
    # Read on a Redis client of the test's own: the server's was closed by its stop (one read
    # through it while it stopped opened a connection after the close, left open at the loop's end).
    assert [a.how for a in (await queue.get(job_id)).attempts] == ["released"]


async def test_what_an_agent_sends_is_bounded_as_a_workers_is(pool: Pool) -> None:
    """issue 44 item 1, a reviewer: anyone with a token could offer a machine and fill the pool's
    Redis: append_log calls of 100 000 chunks each grew a log far past log_max_bytes (log.lua trims
    1000 entries a call), an outcome's detail and result of megabytes were recorded as they came,
    and an offer of 5000 queues made the server read them all on every wait for work. Now a call
    carries at most what a worker's own sends (16 chunks of 64 KiB), an outcome a bounded detail
    and result whose artifacts lie under the attempt's own prefix, an offer a few queues; each
    refusal a sentence, nothing written. And each agent's worker id is its own."""
    async with pool.client("alice") as alice:
        many = ServeJobs(1, [f"q{i}" for i in range(1000)], [], 0.0, "node-a", False, {}, 60.0, 10.0)
        message = await refused(alice.call(many, Served), ErrorCode.INVALID_ARGUMENT)
        assert f"at most {agents.MAX_AGENT_QUEUES} queues" in message
    job_id = await enqueue(pool, "alice")
    async with ScriptedAgent(pool, "alice") as agent:
        run = await agent.next("run")
        async with ScriptedAgent(pool, "alice") as twin:  # offered after: the one job is `agent`'s
            assert agent.worker != twin.worker
        assert len(agent.worker.rsplit("-", 1)[1]) >= 16  # 64 random bits, not 24
        flood = {"number": 1, "chunks": [b"x"] * (agents.MAX_LOG_CHUNKS + 1)}
        message = await refused(agent.call(run.lease_id, "append_log", flood), ErrorCode.INVALID_ARGUMENT)
        assert f"at most {agents.MAX_LOG_CHUNKS} chunks" in message
        big = {"number": 1, "chunks": [b"x" * (agents.MAX_LOG_CHUNK + 1)]}
        await refused(agent.call(run.lease_id, "append_log", big), ErrorCode.INVALID_ARGUMENT)
        assert await pool.queue.read_log(job_id) == []
        await agent.call(run.lease_id, "exited")
        huge = dict(SUCCEEDED, detail="d" * 100_000)
        ended = {"ending": "exited", "outcome": huge, "dirty_gpus": {}}
        message = await refused(agent.call(run.lease_id, "ended", ended), ErrorCode.INVALID_ARGUMENT)
        assert "detail" in message
        stolen = {
            "artifacts": [{"name": "m", "size": 1, "key": "artifacts/default.other/x/out/m", "sha256": ""}]
        }
        ended["outcome"] = dict(SUCCEEDED, result=stolen)
        message = await refused(agent.call(run.lease_id, "ended", ended), ErrorCode.INVALID_ARGUMENT)
        assert "its own" in message
        assert (await pool.queue.get(job_id)).state is JobState.RUNNING
        await agent.call(run.lease_id, "ended", {"ending": "exited", "outcome": SUCCEEDED, "dirty_gpus": {}})
        await agent.next("tidy")
        await agent.call(run.lease_id, "tidied")
        assert (await wait_for(pool, job_id))["state"] == JobState.SUCCEEDED
