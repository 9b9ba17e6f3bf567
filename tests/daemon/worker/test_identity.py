"""Jobs never run with the daemon's identity (issue 14, findings 1, 4 and 5): a root worker with
`job_uid_range` runs each slot's jobs under a uid of its own, without capabilities, in a clean
environment. Real jobs, real uids (the tests run as root), each probing what a hostile job would."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from daemon.job import JobInfo, JobSpec, JobState
from daemon.queue.job_queue import JobQueue
from daemon.spec_checks import project_id
from daemon.worker import _spawn
from daemon.worker.cgroups import SlotCgroups
from daemon.worker.dispatcher import Worker
from daemon.worker.identity import DEFAULT_UIDS, IdentityError, SlotIdentity, slot_identities
from daemon.worker.spawn import Spawner
from storage.content import content_key, pack_files, pack_tree
from storage.local import LocalStore
from tests.support import uids
from tests.support.git_repo import make_repo
from tests.support.workers import alive, running_worker, sh, wait_file, wait_state

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching uids needs root")

FIRST_UID = uids.uid(0)


@pytest.fixture
async def worker(
    queue: JobQueue, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Worker]:
    """A root worker with two slot uids; in a cgroup per slot where this kernel allows, unless
    the test asks for the fallback (`indirect` param "no cgroups": the uid is swept as itself)."""
    if getattr(request, "param", "") == "no cgroups":
        monkeypatch.setattr(SlotCgroups, "make", lambda *_: None)
    async with hardened_worker(queue) as w:
        yield w


@contextlib.asynccontextmanager
async def hardened_worker(queue: JobQueue, **kw: Any) -> AsyncIterator[Worker]:
    """A root worker with two slot uids, as the shipped unit runs it; `kw` goes to the Worker."""
    identities = slot_identities(f"{FIRST_UID}-{FIRST_UID + 1}", 2)
    env = {"PATH": os.environ["PATH"], "AWS_SECRET_ACCESS_KEY": "the-daemons-own", "LANG": "C.UTF-8"}
    # In /tmp, passable by the jobs' uids: pytest's own directories are root's, 0700 (and a worker
    # whose slots the uids cannot reach refuses to start: the last test below).
    data = Path(tempfile.mkdtemp(prefix="gpupool-worker-"))
    data.chmod(0o711)
    try:
        async with running_worker(queue, data / "w", slots=2, identities=identities, env=env, **kw) as w:
            yield w
    finally:
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def drop() -> Iterator[Path]:
    """A directory every uid may write (in /tmp: pytest's own directories are root's, 0700), for
    jobs to leave what the test reads."""
    path = Path(tempfile.mkdtemp(prefix="gpupool-drop-"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def run(queue: JobQueue, script: str, **kw: object) -> JobInfo:
    job_id, _ = await queue.enqueue(sh(script, **kw))
    return await wait_state(queue, job_id, JobState.SUCCEEDED, JobState.FAILED)


async def output(queue: JobQueue, info: JobInfo) -> str:
    return b"".join(data for _, data in await queue.read_log(info.id)).decode()


def uid_processes(uids: set[int]) -> list[int]:
    """The pids of live processes of `uids`. A process that ends while the list is read (on a
    machine that runs other tests meanwhile, many do) is left out, not raised as NoSuchProcess."""
    return [
        p.info["pid"]
        for p in psutil.process_iter(["pid", "uids", "status"])
        if p.info["uids"] is not None and p.info["uids"].real in uids and p.info["status"] != "zombie"
    ]


async def test_a_job_runs_as_its_slots_uid_without_capabilities_or_the_daemons_environment(
    queue: JobQueue, worker: Worker
) -> None:
    fields = "Uid|Gid|Groups|CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs"
    info = await run(queue, f'grep -E "^({fields}):" /proc/self/status; env')
    assert info.state is JobState.SUCCEEDED, await output(queue, info)
    lines = (await output(queue, info)).splitlines()
    status = {line.split(":")[0]: line.split()[1:] for line in lines[:9]}
    # real, effective, saved and filesystem ids all the slot's: nothing to switch back to
    assert status["Uid"] == status["Gid"] == [str(FIRST_UID)] * 4
    assert status["Groups"] == []
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert status[cap] == ["0000000000000000"], cap
    assert status["NoNewPrivs"] == ["1"]
    env = dict(line.split("=", 1) for line in lines[9:] if "=" in line)
    assert "AWS_SECRET_ACCESS_KEY" not in env  # the daemon's environment stays the daemon's
    assert env["LANG"] == "C.UTF-8"
    assert env["HOME"] == str(worker._slots.dir(0) / "work")
    assert env["TMPDIR"] == str(worker._slots.dir(0) / "tmp")  # its own, emptied after it


async def test_a_job_cannot_read_the_daemons_secrets(queue: JobQueue, worker: Worker, tmp_path: Path) -> None:
    secret = worker.data_dir / "password"  # as the embedded Redis keeps its password: 0600
    secret.write_text("hunter2\n")
    secret.chmod(0o600)
    info = await run(queue, f"cat {secret}; ls {worker.data_dir}; echo done")
    out = await output(queue, info)
    assert "hunter2" not in out
    assert "Permission denied" in out
    assert out.rstrip().endswith("done")


async def test_two_jobs_can_neither_read_nor_signal_each_other(
    queue: JobQueue, worker: Worker, drop: Path
) -> None:
    victim, _ = await queue.enqueue(
        sh(f"echo $$ > {drop}/victim; exec sleep 30", env={"HF_TOKEN": "hf_victims"})
    )
    pid = int((await wait_file(drop / "victim"))[0])
    victims_dir = worker._slots.dir(0) / "work"
    probe = await run(
        queue, f"cat /proc/{pid}/environ; kill -9 {pid} && echo KILLED; ls {victims_dir}; echo probed"
    )
    out = await output(queue, probe)
    assert "hf_victims" not in out
    assert "KILLED" not in out
    assert out.rstrip().endswith("probed")
    assert psutil.Process(pid).uids().real == FIRST_UID  # alive, as slot 0's uid
    await queue.cancel(victim)
    await wait_state(queue, victim, JobState.CANCELLED)


BOTH_WAYS = pytest.mark.parametrize("worker", ["cgroups", "no cgroups"], indirect=True)


@BOTH_WAYS
async def test_nothing_of_a_job_outlives_it_however_it_escaped(
    queue: JobQueue, worker: Worker, drop: Path
) -> None:
    script = f"setsid -f env -i sh -c 'echo $$ > {drop}/escaped; exec sleep 120'; sleep 0.5"
    info = await run(queue, script)
    assert info.state is JobState.SUCCEEDED
    escaped = int((await wait_file(drop / "escaped"))[0])
    # Escaped with setsid and env -i: dead before the job's end was recorded (an orphan, it is
    # init's to reap: a zombie at most).
    assert not alive(escaped)
    uids = {FIRST_UID, FIRST_UID + 1}
    assert uid_processes(uids) == []


async def test_a_job_cannot_make_itself_less_nice_than_the_configured_niceness(
    queue: JobQueue, tmp_path: Path
) -> None:
    """Jobs run nicer than their worker (`job_nice`), so that the pool's own work is not starved;
    a job's uid cannot undo that (only root may lower a niceness)."""
    data = Path(tempfile.mkdtemp(prefix="gpupool-worker-"))
    data.chmod(0o711)
    worker_nice = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        identities = slot_identities(f"{FIRST_UID}-{FIRST_UID + 1}", 2)
        async with running_worker(queue, data / "w", slots=2, identities=identities, job_nice=5):
            info = await run(queue, f"renice -n {worker_nice} -p $$; ps -o ni= -p $$")
    finally:
        shutil.rmtree(data, ignore_errors=True)
    assert info.state is JobState.SUCCEEDED
    assert (await output(queue, info)).split()[-1] == str(worker_nice + 5), await output(queue, info)


async def test_a_worker_whose_slots_its_uids_cannot_reach_refuses_to_start(
    queue: JobQueue, tmp_path: Path
) -> None:
    identities = slot_identities(f"{FIRST_UID}-{FIRST_UID + 1}", 2)
    hidden = tmp_path / "hidden"
    hidden.mkdir(mode=0o700)
    with pytest.raises(IdentityError, match=f"cannot pass through {hidden}"):
        async with running_worker(queue, hidden / "w", slots=2, identities=identities):
            pass


def test_a_uid_range_that_cannot_serve_is_refused_saying_why() -> None:
    # fewer uids than slots: as many slots as uids (the worker says so: tests/daemon/test_poold.py)
    assert len(slot_identities(f"{FIRST_UID}-{FIRST_UID + 1}", 3) or ()) == 2
    with pytest.raises(ValueError, match="FIRST-LAST"):
        slot_identities(str(FIRST_UID), 1)
    with pytest.raises(ValueError, match="uids of no real user"):
        slot_identities("0-10", 1)


def test_root_with_no_range_leases_uids_no_other_poold_on_the_machine_holds(tmp_path: Path) -> None:
    """issue 44 item 8: a root worker given no job_uid_range runs its jobs as uids it leases, not
    as root; two poolds on one machine (here two leases of one process, which conflict the same
    way: one flock per open file) never share one, and a lease ends with the process that held
    it. Running jobs as root is the explicit `job_uid_range = "root"`."""
    first = slot_identities("", 3)
    second = slot_identities("", 2)
    assert first is not None
    assert second is not None
    ours = {i.uid for i in first} | {i.uid for i in second}
    assert len(ours) == 5
    assert ours <= set(DEFAULT_UIDS)
    assert all(i.gid == i.uid for i in first + second)
    assert slot_identities("root", 2) is None
    # another process leases around ours; once it has ended, its uids are free again
    lease = "from daemon.worker.identity import lease_uids; print(*lease_uids(2))"
    theirs = subprocess.run(
        [sys.executable, "-c", lease], capture_output=True, text=True, check=True, timeout=60
    )
    assert not ours & {int(u) for u in theirs.stdout.split()}
    again = subprocess.run(
        [sys.executable, "-c", lease], capture_output=True, text=True, check=True, timeout=60
    )
    assert again.stdout == theirs.stdout


async def test_nothing_of_the_job_reaches_the_root_side_of_the_switch(
    queue: JobQueue, worker: Worker
) -> None:
    """Review of issue 14: the job's environment once went to setpriv, which ran as root until it
    switched (an LD_PRELOAD of the job's would have run as root in it); the environment now goes
    to the job's own exec only. Every dynamically linked process that starts with a missing
    LD_PRELOAD says so once: only the job's own may."""
    info = await run(queue, "true", env={"LD_PRELOAD": "/nonexistent/gpupool-probe.so"})
    said = (await output(queue, info)).count("gpupool-probe.so")
    assert said == 1, await output(queue, info)  # the job's sh, nothing that ran as root


async def test_a_job_cannot_start_in_a_directory_its_uid_may_not_reach(
    queue: JobQueue, worker: Worker, drop: Path
) -> None:
    secret_dir = drop / "root-only"
    (secret_dir / "inside").mkdir(parents=True)
    secret_dir.chmod(0o700)  # root's: a chdir made as root would pass it
    (secret_dir / "inside" / "f").write_text("root's secret\n")
    info = await run(queue, "cat f", cwd=str(secret_dir / "inside"))
    assert info.state is JobState.FAILED
    assert "root's secret" not in await output(queue, info)


@BOTH_WAYS
async def test_a_process_hopping_pids_in_a_fork_loop_is_killed_too(queue: JobQueue, worker: Worker) -> None:
    # Each round forks and the parent exits: a sweep over /proc lists pids that are already gone.
    script = "setsid -f sh -c 'hop() { ( sleep 0.01; hop ) & exit 0; }; hop'; sleep 0.5"
    info = await run(queue, script)
    assert info.state is JobState.SUCCEEDED
    uids = {FIRST_UID, FIRST_UID + 1}
    for _ in range(3):  # none of the uid's, at three looks in a row
        await asyncio.sleep(0.1)
        assert uid_processes(uids) == []


async def test_under_a_strict_umask_a_job_still_reaches_its_home_and_output(
    queue: JobQueue, worker: Worker
) -> None:
    old = os.umask(0o027)  # the worker unit's UMask=
    try:
        info = await run(queue, 'touch "$HOME/h" "$GPUPOOL_OUTPUT/o" && echo wrote')
    finally:
        os.umask(old)
    assert info.state is JobState.SUCCEEDED, await output(queue, info)


async def test_a_jobs_temporary_files_go_with_its_attempt(queue: JobQueue, worker: Worker) -> None:
    """The slot's uid serves every user whose jobs land on the slot: what one job leaves in its
    TMPDIR must not be there for the next."""
    first = await run(queue, 'f=$(mktemp); echo "secret" > "$f"; echo "$f"')
    assert first.state is JobState.SUCCEEDED, await output(queue, first)
    left = Path((await output(queue, first)).split()[-1])
    assert left.parent == worker._slots.dir(0) / "tmp" or left.parent == worker._slots.dir(1) / "tmp"
    assert not left.exists()


# A default ACL giving slot 1's uid everything in a directory: files made in it get it too.
GIVE_TO_SLOT_1 = f"""
import os, struct, sys
entry = lambda tag, perm, who=0xFFFFFFFF: struct.pack("<HHI", tag, perm, who)
acl = struct.pack("<I", 2) + entry(1, 7) + entry(2, 7, {FIRST_UID + 1}) + entry(4, 0)
acl += entry(0x10, 7) + entry(0x20, 0)
for d in sys.argv[1:]:
    os.setxattr(d, "system.posix_acl_default", acl)
"""


async def test_what_a_job_did_to_its_directories_does_not_reach_the_next_job_of_its_slot(
    queue: JobQueue, worker: Worker
) -> None:
    """A slot's directories serve job after job, each maybe another user's. A job may open its
    own HOME, output and TMPDIR to everyone (a mode, a default ACL): the next job of the slot
    must not inherit that, or another slot's job could read what it writes there."""
    dirs = '"$HOME" "$GPUPOOL_OUTPUT" "$TMPDIR"'
    first = await run(queue, f"chmod 0777 {dirs} && python3 -c '{GIVE_TO_SLOT_1}' {dirs} && echo opened")
    assert first.state is JobState.SUCCEEDED, await output(queue, first)
    look = "import os, sys\nfor d in sys.argv[1:]: print(oct(os.stat(d).st_mode & 0o7777), os.listxattr(d))"
    second = await run(queue, f"python3 -c '{look}' {dirs}")  # on slot 0 both times: the first free
    assert second.state is JobState.SUCCEEDED, await output(queue, second)
    assert (await output(queue, second)).splitlines() == ["0o700 []"] * 3


async def test_what_a_job_leaves_in_the_machines_shared_temporary_directories_goes_with_it(
    queue: JobQueue, worker: Worker
) -> None:
    """/tmp, /var/tmp and /dev/shm are the whole machine's: what a job left there under its slot's
    uid (a crashed DataLoader's shared memory, a file a program wrote to /tmp by name) would be
    readable by the next job of that uid, another user's. Removed when the attempt ends, without
    following a link out and without touching what is not the uid's."""
    ours = Path(tempfile.mkstemp(prefix="gpupool-roots-")[1])  # root's, in /tmp: stays
    try:
        script = (
            "n=gpupool-left-$GPUPOOL_JOB_ID; umask 077; echo secret > /tmp/$n; echo secret > /dev/shm/$n; "
            "mkdir -p /var/tmp/$n/sub; echo secret > /var/tmp/$n/sub/f; chmod 0 /var/tmp/$n/sub; "
            f"ln -s {ours} /tmp/$n.link; echo $n"
        )
        info = await run(queue, script)
        assert info.state is JobState.SUCCEEDED, await output(queue, info)
        name = (await output(queue, info)).split()[-1]
        for left in (f"/tmp/{name}", f"/dev/shm/{name}", f"/var/tmp/{name}", f"/tmp/{name}.link"):
            assert not os.path.lexists(left), left
        assert ours.exists()
    finally:
        ours.unlink()


async def test_a_starting_worker_ends_what_its_slot_uids_left_behind(queue: JobQueue) -> None:
    """A worker that died (with its orphan guard) may have left processes and temporary files of
    its slots' uids: the first job of a slot must not meet them."""
    uid = FIRST_UID + 1
    left = Path(tempfile.mkstemp(prefix="gpupool-crashed-")[1])
    os.chown(left, uid, uid)
    stray = subprocess.Popen(["sleep", "60"], user=uid, group=uid, extra_groups=[], start_new_session=True)
    data = Path(tempfile.mkdtemp(prefix="gpupool-worker-"))
    data.chmod(0o711)
    try:
        identities = slot_identities(f"{FIRST_UID}-{FIRST_UID + 1}", 2)
        async with running_worker(queue, data / "w", slots=2, identities=identities):
            assert await asyncio.to_thread(stray.wait, 10) == -9
            assert not left.exists()
    finally:
        if stray.poll() is None:
            stray.kill()
            stray.wait()
        left.unlink(missing_ok=True)
        shutil.rmtree(data, ignore_errors=True)


def sysv_objects(uids: set[int]) -> list[str]:
    """System V IPC objects (shared memory, semaphores, queues) owned by one of `uids`."""
    found = []
    for kind, column in (("shm", 7), ("sem", 4), ("msg", 7)):
        for line in Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]:
            if int(line.split()[column]) in uids:
                found.append(f"{kind} {line.split()[1]}")
    return found


@pytest.mark.skipif(shutil.which("ipcmk") is None, reason="needs util-linux's ipcmk")
async def test_the_system_v_ipc_a_job_made_goes_with_it(queue: JobQueue, worker: Worker) -> None:
    """Shared memory, semaphores and message queues outlive their processes: the next job of the
    slot's uid, another user's, would find them (and what was written into them)."""
    uids = {FIRST_UID, FIRST_UID + 1}
    info = await run(queue, "ipcmk -M 4096 && ipcmk -S 1 && ipcmk -Q")
    assert info.state is JobState.SUCCEEDED, await output(queue, info)
    assert "Shared memory id" in await output(queue, info)
    assert sysv_objects(uids) == []


@pytest.mark.parametrize("worker", ["no cgroups"], indirect=True)
async def test_a_job_stopping_everything_of_its_uid_cannot_stop_the_worker(
    queue: JobQueue, worker: Worker
) -> None:
    """Without a cgroup, a slot's uid is killed by a child running as that uid, which any process
    of the uid may SIGSTOP: a leftover stopping all it can, in a loop, must not stall the worker's
    end of the job (nor, with it, the slot)."""
    # The stopper stops the job's own sleep too: the timeout ends that, and then the sweep meets
    # a process stopping everything of the uid it can, sweepers included.
    stopper = "setsid -f sh -c 'while :; do kill -STOP -1; done' >/dev/null 2>&1; exec sleep 30"
    first = await run(queue, stopper, timeout=2)
    assert "timed out" in (first.detail or ""), await output(queue, first)
    second = await run(queue, "echo still served")
    assert "still served" in await output(queue, second)
    uids = {FIRST_UID, FIRST_UID + 1}
    assert uid_processes(uids) == []


async def test_killing_a_uid_that_stops_its_killer_returns_all_the_same(spawner: Spawner) -> None:
    """The sweeper runs as the uid it kills, so the uid's processes may SIGSTOP it: ending the uid
    must come back anyway (and the stoppers end), never wait on it for ever."""
    uid = FIRST_UID + 1
    for _ in range(10):
        stopper = subprocess.Popen(  # one: two would stop each other
            ["sh", "-c", "while :; do kill -STOP -1; done"], user=uid, group=uid, extra_groups=[]
        )
        await asyncio.sleep(0.05)
        assert await asyncio.wait_for(spawner.kill_uid(SlotIdentity(uid, uid)), 10) == []
        assert await asyncio.to_thread(stopper.wait, 5) == -9


# (A uid of no test process's: refused before anything runs; a fixed one, so every xdist worker
# collects the same test ids.)
@pytest.mark.parametrize(("uid", "gid"), [(0, 0), (61000, 0), (-1, 61000), (2**32 - 1, 61000)])
def test_the_c_module_refuses_root_and_keep_as_a_slots_ids(uid: int, gid: int) -> None:
    """kill(-1) as root would end the machine, and setres*id(-1) keeps the worker's id: a slot id
    must be a real one above 0, whoever asks."""
    with pytest.raises(ValueError, match="above 0"):
        _spawn.sweep(uid, gid)
    with pytest.raises(ValueError, match="above 0"):
        _spawn.spawn([b"/bin/true"], [b"true"], [], b"/", 0, 1, uid, gid, -1, False, -100, [], False, False)


async def test_a_git_job_runs_on_a_hardened_worker_and_can_use_its_checkout(
    queue: JobQueue, worker: Worker, tmp_path: Path
) -> None:
    """issue 43 item 6: on a root worker with `job_uid_range` (the shipped unit) every `--git`
    job failed with git's "dubious ownership": the worker checks the code out, as root, into the
    job's directory, which is its slot uid's. The job then runs git in its checkout, as its uid."""
    repo = tmp_path / "repo"
    first, _ = make_repo(repo)
    script = "cat version.txt; id -u; git rev-parse HEAD; git status --porcelain; echo done"
    job_id, _ = await queue.enqueue(
        JobSpec(argv=("sh", "-c", script), git={"repo": str(repo), "commit": first})
    )
    info = await wait_state(queue, job_id, JobState.SUCCEEDED, JobState.FAILED)
    said = await output(queue, info)
    assert info.state is JobState.SUCCEEDED, said
    # its code at the commit, as its uid; git works there for the job too, and finds it clean
    assert said.splitlines()[-4:] == ["one", str(FIRST_UID), first, "done"], said


async def test_a_snapshot_job_runs_on_a_hardened_worker_and_can_change_its_files(
    queue: JobQueue, tmp_path: Path
) -> None:
    """issue 43 item 6, the other way code reaches a job (`--snapshot`): unpacked by the worker,
    as root, into the slot uid's directory, then the job's own to read and change. No git runs
    on the worker for it, and it passed before the fix too: it keeps it so."""
    src = tmp_path / "project"
    (src / "sub").mkdir(parents=True)
    (src / "msg.txt").write_text("snapshot\n")
    (src / "sub" / "x").write_text("inner\n")
    tar = b"".join(pack_tree(src))
    sha = hashlib.sha256(tar).hexdigest()
    snapshot = {"sha256": sha, "commit": "0" * 40, "dirty": False}
    script = "cat msg.txt sub/x; id -u; echo changed > msg.txt; touch sub/new; cat msg.txt; echo done"
    async with LocalStore(tmp_path / "store") as store:
        await store.put_bytes(content_key(sha), tar)
        async with hardened_worker(queue, store=store):
            info = await run(queue, script, snapshot=snapshot)
    said = await output(queue, info)
    assert info.state is JobState.SUCCEEDED, said
    assert said.splitlines()[-5:] == ["snapshot", "inner", str(FIRST_UID), "changed", "done"], said


async def test_a_project_job_runs_on_a_hardened_worker_in_its_start_directory(
    queue: JobQueue, tmp_path: Path
) -> None:
    """issue 45 item 1: a project's packs are unpacked by the root worker one after another into
    the slot uid's directory, the directory the job starts in made where no file of it is there,
    and all of it is the job's own to change."""
    src = tmp_path / "project"
    (src / "sub").mkdir(parents=True)
    (src / "msg.txt").write_text("project\n")
    (src / "sub" / "x").write_text("inner\n")
    packs = []
    async with LocalStore(tmp_path / "store") as store:
        for names in (["msg.txt"], ["sub/x"]):
            tar = b"".join(pack_files(src, names))
            packs.append(hashlib.sha256(tar).hexdigest())
            await store.put_bytes(content_key(packs[-1]), tar)
        project = {"id": project_id(packs), "packs": packs, "dir": "sub/made", "commit": "", "dirty": True}
        project |= {"files": 2, "size": 14}
        script = "pwd; cat ../../msg.txt ../x; id -u; echo changed > ../../msg.txt; touch new; echo done"
        async with hardened_worker(queue, store=store):
            info = await run(queue, script, project=project)
    said = await output(queue, info)
    assert info.state is JobState.SUCCEEDED, said
    lines = said.splitlines()
    assert lines[-5].endswith("/work/sub/made"), said
    assert lines[-4:] == ["project", "inner", str(FIRST_UID), "done"], said
