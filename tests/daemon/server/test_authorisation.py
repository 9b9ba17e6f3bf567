"""Who may do what (issue 14, findings 2 and 3): a user acts only on their own jobs and datasets;
others' jobs are seen without their secrets; an admin, marked in the tokens file, may act on any.

Real server, real Redis, two users and an admin over real connections; the test stands in for the
worker (it claims and completes through the queue), as the rest of this tier does."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from daemon.client.pool_client import ClientError
from daemon.job import JobState, Outcome
from daemon.queue.embedded_redis import EmbeddedRedis
from protocol import (
    CancelJobs,
    Cancelled,
    DownloadTicket,
    Enqueue,
    Enqueued,
    ErrorCode,
    FinishUpload,
    FollowLogs,
    JobDetail,
    JobList,
    ListJobs,
    LogEnd,
    ObjectRef,
    PrepareDownload,
    PrepareUpload,
    ResolveName,
    ShowJob,
    UploadTicket,
    Waited,
    WaitJobs,
)
from protocol.codec import Reply, Request
from storage.local import LocalStore
from tests.support.pool import Pool, running_pool

SECRET = "wandb-0123456789abcdef"


@pytest.fixture
async def shared_pool(redis_server: EmbeddedRedis, tmp_path: Path) -> AsyncIterator[Pool]:
    store = LocalStore(tmp_path / "store")
    async with running_pool(
        redis_server, tmp_path, store=store, users=("alice", "bob", "root"), admins=("root",)
    ) as p:
        yield p


async def alices_job(pool: Pool) -> str:
    async with pool.client("alice") as alice:
        spec = {
            "argv": ["python", "train.py"],
            "env": {"WANDB_API_KEY": SECRET},
            "git": {"repo": f"https://alice:{SECRET}@git.example/alice/model.git", "ref": "main"},
        }
        return (await alice.call(Enqueue(spec, None), Enqueued)).job_id


async def refused(pool: Pool, user: str, request: Request, reply: type[Reply]) -> str:
    async with pool.client(user) as c:
        with pytest.raises(ClientError) as err:
            await c.call(request, reply)
    assert err.value.code == ErrorCode.PERMISSION_DENIED, err.value
    return err.value.message


async def test_bob_cannot_cancel_wait_on_or_read_the_log_of_alices_job(shared_pool: Pool) -> None:
    job_id = await alices_job(shared_pool)
    async with shared_pool.client("bob") as bob:
        assert (await bob.call(CancelJobs([job_id]), Cancelled)).states == {job_id: "not_yours"}
    assert (await shared_pool.queue.get(job_id)).state is JobState.QUEUED
    message = await refused(shared_pool, "bob", WaitJobs([job_id], 0.1), Waited)
    assert "belongs to alice" in message
    assert "admin" in message
    await refused(shared_pool, "bob", FollowLogs(job_id, False, ""), LogEnd)
    async with shared_pool.client("root") as admin:  # an admin may act on any job
        assert (await admin.call(CancelJobs([job_id]), Cancelled)).states == {job_id: "cancelled"}


async def test_others_see_alices_jobs_without_their_environment_values_or_results(shared_pool: Pool) -> None:
    job_id = await alices_job(shared_pool)
    lease = await shared_pool.queue.claim("w1", ["default"])
    assert lease is not None
    await shared_pool.queue.complete(lease, Outcome(JobState.SUCCEEDED, 0, result={"tail": SECRET}))
    for user, sees_secrets in (("alice", True), ("bob", False), ("root", True)):
        async with shared_pool.client(user) as c:
            shown = (await c.call(ShowJob(job_id), JobDetail)).job
            listed = (await c.call(ListJobs(None, None, True, 100), JobList)).jobs
        assert [j["id"] for j in listed] == [job_id]  # metadata stays visible to everyone
        for record in (shown, listed[0]):
            assert record["spec"]["user"] == "alice"
            assert record["state"] == "succeeded"
            assert list(record["spec"]["env"]) == ["WANDB_API_KEY"]
            assert (SECRET in str(record)) is sees_secrets, (user, record)


async def test_bob_cannot_download_alices_artifacts(shared_pool: Pool) -> None:
    job_id = await alices_job(shared_pool)
    key = f"artifacts/{job_id}/1/model.pt"
    await shared_pool.server.store.put_bytes(key, b"weights")
    await refused(shared_pool, "bob", PrepareDownload(key), DownloadTicket)
    async with shared_pool.client("alice") as alice:  # past the owner check: the object is there
        assert (await alice.call(PrepareDownload(key), DownloadTicket)).size == 7


async def test_a_key_that_climbs_out_of_its_job_is_a_mistake_not_a_store_failure(shared_pool: Pool) -> None:
    job_id = await alices_job(shared_pool)
    async with shared_pool.client("alice") as alice:
        with pytest.raises(ClientError) as err:
            await alice.call(PrepareDownload(f"artifacts/{job_id}/../../sha256/{'0' * 64}"), DownloadTicket)
    assert err.value.code == ErrorCode.INVALID_ARGUMENT, err.value  # not UNAVAILABLE: retrying is no use
    assert "segments must be non-empty and not '.' or '..'" in err.value.message


async def put_named(pool: Pool, user: str, data: bytes, name: str) -> ObjectRef:
    sha = hashlib.sha256(data).hexdigest()
    async with pool.client(user) as c:
        ticket = await c.call(PrepareUpload(sha, len(data)), UploadTicket)
        if not ticket.exists:
            await pool.server.store.put_bytes(ticket.key, data)
        return await c.call(FinishUpload(sha, "file", name), ObjectRef)


async def test_dataset_names_are_each_users_own(shared_pool: Pool) -> None:
    mine = await put_named(shared_pool, "alice", b"the real imagenet", "imagenet")
    await put_named(shared_pool, "bob", b"evil", "imagenet")  # bob's own imagenet, not alice's
    async with shared_pool.client("alice") as alice:
        assert (await alice.call(ResolveName("imagenet"), ObjectRef)).sha256 == mine.sha256
    async with shared_pool.client("root") as admin:
        with pytest.raises(ClientError) as err:
            await admin.call(ResolveName("imagenet"), ObjectRef)
    assert err.value.code == ErrorCode.NOT_FOUND  # root has no dataset of that name


async def test_a_content_address_is_no_key_to_the_bytes(shared_pool: Pool) -> None:
    alices = await put_named(shared_pool, "alice", b"alice's private data", "private")
    key = f"sha256/{alices.sha256[:2]}/{alices.sha256}"
    message = await refused(shared_pool, "bob", PrepareDownload(key), DownloadTicket)
    assert "content address" in message
    async with shared_pool.client("root") as admin:
        assert (await admin.call(PrepareDownload(key), DownloadTicket)).size == len(b"alice's private data")


async def test_a_priority_above_the_users_ceiling_is_refused_and_nothing_is_queued(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """Ceilings: alice's own in the tokens file, bob's the pool's default, root (an admin) none."""
    async with running_pool(
        redis_server,
        tmp_path,
        users=("alice", "bob", "root"),
        admins=("root",),
        max_priority={"alice": 10},
        default_max_priority=2,
    ) as pool:
        for user, allowed in (("alice", 10), ("bob", 2), ("root", 100)):
            async with pool.client(user) as c:
                job = await c.call(Enqueue({"argv": ["true"], "priority": allowed}, None), Enqueued)
                assert (await pool.queue.get(job.job_id)).spec.priority == allowed
        for user, ceiling in (("alice", 10), ("bob", 2)):
            message = await refused(
                pool, user, Enqueue({"argv": ["true"], "priority": ceiling + 1}, None), Enqueued
            )
            assert f"priority {ceiling + 1} is above your ceiling of {ceiling}" in message
            assert "max_priority" in message
        assert await pool.queue.depth("default") == 3  # the refused ones were not queued
