"""What a job with a slot's uid reaches of its machine beyond what it was given (issue 44 items 4
and 7; daemon/worker/confine.py): GPU device nodes it was not given, what the previous job of its
uid left in the kernel (keyrings, message queues, lock files), and other jobs' IPC and loopback.
Real jobs, real uids (the tests run as root), stand-in GPU device nodes."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import random
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Collection, Iterator
from pathlib import Path

import pytest

from daemon.job import JobState
from daemon.queue.job_queue import JobQueue
from daemon.worker import _spawn
from daemon.worker.confine import Confinement
from daemon.worker.forwards import connect_in_job
from daemon.worker.gpus import GpuInfo
from daemon.worker.identity import IdentityError, SlotIdentity
from daemon.worker.spawn import Spawner
from tests.daemon.worker.test_identity import FIRST_UID, hardened_worker, output, run
from tests.support.workers import running_worker

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching uids and namespaces need root")

ALICE = SlotIdentity(FIRST_UID, FIRST_UID)  # one slot's uid, whose jobs are anyone's
BOB = SlotIdentity(FIRST_UID + 1, FIRST_UID + 1)  # another slot's, running beside it
ENV = {"PATH": os.environ["PATH"]}
STAND_INS = 4  # /dev/nvidia0..3
OPEN_GPUS = f"""
import errno, os
for n in range({STAND_INS}):
    try:
        os.close(os.open(f"/dev/nvidia{{n}}", os.O_RDWR))
        print(n, "opened")
    except OSError as exc:
        print(n, errno.errorcode[exc.errno])
"""


@pytest.fixture
def stand_in_gpus() -> Iterator[None]:
    with stand_ins():
        yield


@contextlib.contextmanager
def stand_ins() -> Iterator[None]:
    """/dev/nvidia0..3 as the driver makes them (c 195 N, 0666), with no driver behind them: a job
    allowed one gets ENXIO opening it, one kept from it EACCES. Never on a machine with a real
    GPU (its nodes are the driver's: the GPU device check covers it, tests/gpu/check_devices.sh)."""
    nodes = [Path(f"/dev/nvidia{n}") for n in range(STAND_INS)]
    if any(node.exists() for node in nodes):
        pytest.skip("this machine has /dev/nvidia* of its own: tests/gpu/check_devices.sh checks a real GPU")
    try:
        for n, node in enumerate(nodes):
            os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(195, n))
            node.chmod(0o666)  # whatever the umask
        yield
    finally:
        for node in nodes:
            node.unlink(missing_ok=True)


async def job(spawner: Spawner, identity: SlotIdentity, code: str, gpus: Collection[int] | None = ()) -> str:
    """Run the Python `code` as `identity`, in /, and return what it printed (it must exit 0)."""
    child = spawner.spawn(["python3", "-c", code], cwd=Path("/"), env=ENV, identity=identity, gpus=gpus)
    out = await asyncio.to_thread(read_all, child.output)
    assert await asyncio.wait_for(child.wait(), 30) == 0, out
    return out


def read_all(fd: int) -> str:
    chunks = []
    with contextlib.closing(os.fdopen(fd, "rb")) as pipe:
        while data := pipe.read(65536):
            chunks.append(data)
    return b"".join(chunks).decode()


def opened(out: str) -> dict[int, str]:
    return {int(line.split()[0]): line.split()[1] for line in out.splitlines()}


@contextlib.asynccontextmanager
async def spawner_of(confinement: Confinement | None = None) -> AsyncIterator[Spawner]:
    spawner = Spawner(confinement=confinement)
    try:
        yield spawner
    finally:
        await spawner.close()


@pytest.mark.usefixtures("stand_in_gpus")
async def test_a_job_opens_only_the_gpu_devices_it_was_given() -> None:
    """issue 44 item 4: CUDA_VISIBLE_DEVICES alone confined a job; one that unset it opened every
    GPU of the machine, other users' included. A node not given is there but cannot be opened,
    and hiding it changes nothing outside the job."""
    async with spawner_of() as spawner:
        assert opened(await job(spawner, ALICE, OPEN_GPUS, gpus={1})) == {
            0: "EACCES",
            1: "ENXIO",  # allowed: the stand-in has no driver behind it
            2: "EACCES",
            3: "EACCES",
        }
        assert set(opened(await job(spawner, BOB, OPEN_GPUS, gpus=set())).values()) == {"EACCES"}
        assert set(opened(await job(spawner, BOB, OPEN_GPUS, gpus=None)).values()) == {"ENXIO"}  # unknown
    with pytest.raises(
        OSError, match="No such device or address"
    ) as raised:  # the worker's /dev is as it was
        os.open("/dev/nvidia0", os.O_RDWR)
    assert raised.value.errno == errno.ENXIO
    assert "nvidia" not in Path("/proc/self/mountinfo").read_text()


async def test_gpu_nodes_made_after_the_worker_started_are_hidden_too() -> None:
    """issue 44 item 4: a driver loaded after the worker started makes its nodes then; the
    worker reads /dev again when it has changed (one stat per job), so they are hidden too."""
    async with spawner_of() as spawner:
        if Path("/dev/nvidia0").exists():
            pytest.skip(
                "this machine has /dev/nvidia* of its own: tests/gpu/check_devices.sh checks a real GPU"
            )
        assert set(opened(await job(spawner, ALICE, OPEN_GPUS)).values()) == {"ENOENT"}  # none yet
        with stand_ins():
            out = await job(spawner, ALICE, OPEN_GPUS, gpus={2})
        assert opened(out) == {0: "EACCES", 1: "EACCES", 2: "ENXIO", 3: "EACCES"}


@pytest.mark.usefixtures("stand_in_gpus")
async def test_a_workers_job_opens_only_the_gpus_it_was_allotted(queue: JobQueue) -> None:
    """issue 44 item 4, through the worker: the GPUs' minor numbers (NVML's) decide which node a
    job may open; CUDA_VISIBLE_DEVICES names the same GPU."""
    gpus = [GpuInfo(n, f"GPU-stand-in-{n}", "stand-in", 2**30, minor=n) for n in range(STAND_INS)]
    async with hardened_worker(queue, gpus=gpus):
        script = f"echo $CUDA_VISIBLE_DEVICES; python3 -c '{OPEN_GPUS}'"
        info = await run(queue, script, gpus=1)
        out = await output(queue, info)
        assert info.state is JobState.SUCCEEDED, out
        given = int(out.splitlines()[0].rsplit("-", 1)[1])
        assert opened("\n".join(out.splitlines()[1:])) == {
            n: "ENXIO" if n == given else "EACCES" for n in range(STAND_INS)
        }


KEYCTL = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
SESSION, USER, USER_SESSION = -3, -4, -5
def keyctl(*args):
    return libc.syscall(250, *args)
def add(where, value):  # add_key: refused in the uid's user keyrings, once a job has started
    return libc.syscall(248, b"user", b"secret", value, len(value), where)
def keys(keyring):
    buf = ctypes.create_string_buffer(4096)
    n = keyctl(11, keyring, buf, 4096)  # KEYCTL_READ: 4 bytes per key
    return n // 4 if n >= 0 else -1  # -1: unreadable (locked: the uid cannot even find it)
persistent = keyctl(22, -1, SESSION)  # KEYCTL_GET_PERSISTENT, linked into @s
"""
LEAVE_KEYS = (
    KEYCTL
    + """
add(USER, b"alice-u"); add(USER_SESSION, b"alice-us")
assert add(SESSION, b"alice-s") > 0
assert persistent < 0 or add(persistent, b"alice-p") > 0
"""
)
BREAK_KEYRINGS = """
keyctl(5, USER, 0x0b0b0000)  # KEYCTL_SETPERM: readable, never again writable (refused)
keyctl(3, USER_SESSION)  # KEYCTL_REVOKE (refused)
keyctl(3, persistent)  # allowed: the next job gets a new one
"""
REPLACE_KEYRINGS = """
import time
for keyring, value in ((USER, b"alice-u"), (USER_SESSION, b"alice-us")):
    if keyctl(21, keyring) == 0:  # KEYCTL_INVALIDATE (refused): the kernel makes the uid a new one
        for _ in range(2000):  # once it has collected the old one
            if keyctl(0, keyring, 1) >= 0:  # KEYCTL_GET_KEYRING_ID
                break
            time.sleep(0.001)
    planted = libc.syscall(248, b"user", b"planted", value, len(value), SESSION)
    keyctl(8, planted, keyring)  # KEYCTL_LINK into the new one
    keyctl(5, keyring, 0x1b1b0000)  # and lock it as the worker did
"""
FIND_KEYS = (
    KEYCTL
    + """
linked = keys(SESSION)
print(keys(USER), keys(USER_SESSION), linked - (persistent >= 0 and linked > 0),
      keys(persistent) if persistent >= 0 else 0)
"""
)


@pytest.mark.parametrize(
    "changes",
    ["", BREAK_KEYRINGS, REPLACE_KEYRINGS],
    ids=["keys", "keyrings changed", "keyrings replaced"],
)
async def test_the_next_job_of_a_uid_finds_no_key_of_the_last(changes: str) -> None:
    """issue 44 item 7: a uid's user keyrings (and its persistent one) outlive its processes, and
    the worker's session keyring was every job's: bob's job read the key alice's job left. Nor
    may a job, changing its uid's keyrings, keep the next job of its uid from starting, nor
    invalidate them to be given new ones it could fill and lock as the worker did (a reviewer's
    way round the first lock, which kept the right to search them)."""
    uid = fresh_uid()
    slot = SlotIdentity(uid, uid)
    async with spawner_of() as spawner:
        await job(spawner, slot, LEAVE_KEYS + changes)
        # the user keyrings out of reach, the others empty (@s: but for the persistent keyring's
        # link), and the job started
        assert (await job(spawner, slot, FIND_KEYS)).split() == ["-1", "-1", "0", "0"]


PLANT_FAKES = (
    KEYCTL
    + """
uid = os.getuid()
for name in (f"_uid.{uid}", f"_uid_ses.{uid}"):  # named as the kernel names the uid's own keyrings
    fake = libc.syscall(248, b"keyring", name.encode(), None, 0, persistent)  # which outlives the job
    assert fake > 0 and keyctl(5, fake, 0x3f010010) == 0  # open; any uid may link it (KEY_OTH_LINK)
    print(fake)
"""
)
KEEP_FAKES = KEYCTL + "for fake in {fakes}:\n    assert keyctl(8, fake, persistent) == 0  # KEYCTL_LINK\n"


@pytest.mark.parametrize("kept", [False, True], ids=["planted", "kept by another uid"])
async def test_a_keyring_a_job_names_as_its_uids_own_keeps_no_later_job_from_starting(kept: bool) -> None:
    """issue 44 item 7: a locked user keyring answers ENOKEY, so the start judged it from
    /proc/keys by its name alone: a job that left an open keyring named `_uid_ses.<uid>` in its
    uid's persistent keyring (emptied only after that look) stopped every later job of its uid
    from starting until the machine restarted. Nor may the same user's job on another slot keep
    such a keyring alive for it, out of reach of the next start's emptying."""
    uid = fresh_uid()
    slot, helper = SlotIdentity(uid, uid), SlotIdentity(uid + 1000, uid + 1000)
    async with spawner_of() as spawner:
        fakes = [int(serial) for serial in (await job(spawner, slot, PLANT_FAKES)).split()]
        if kept:
            await job(spawner, helper, KEEP_FAKES.format(fakes=fakes))
        assert (await job(spawner, slot, FIND_KEYS)).split() == ["-1", "-1", "0", "0"]


LOCK_WITH_A_KEY = (
    KEYCTL
    + """
if keyctl(0, USER, 1) < 0:  # KEYCTL_GET_KEYRING_ID: locked by an earlier run's start, for good
    sys.exit(3)
planted = add(USER, b"left")
assert planted > 0 and keyctl(5, USER, 0x1b1b0000) == 0  # locked as the worker once did, a key in it
"""
)


def fresh_uid() -> int:
    """A uid no run is likely to have used (the kernel keeps a uid's keyrings as earlier runs left
    them), and, with the helper uid 1000 above it, no other test's: above the slot uids workers
    lease (identity.DEFAULT_UIDS, 62000-65533, whose jobs' ends sweep them), and apart from
    a_uid_left_so's 63000-65000, which leaves its keyrings as its program left them."""
    return random.randrange(66000, 67000)


def a_uid_left_so(program: str) -> int:
    """A uid above the leases most in use whose own process ran `program` (its keyrings left as
    it leaves them): one no earlier run has spoiled for good (`program` exits 3 on those)."""
    for uid in random.sample(range(63000, 65000), 50):
        as_uid = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        done = subprocess.run(
            [*as_uid, "/usr/bin/python3", "-c", program],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if done.returncode != 3:
            break
    assert done.returncode == 0, done.stderr
    return uid


async def test_a_keyring_the_uid_can_still_search_is_replaced_before_the_job_starts() -> None:
    """issue 44 item 7: a uid's user keyring locked as the worker locked it before (unwritable,
    searchable), with a key in it, which the start took as emptied: the next job read the key.
    The start now replaces such a keyring (and waits for the kernel's new one) before the job
    runs. Here the uid's own process, not a job, leaves it so, on a uid no start has locked."""
    uid = a_uid_left_so(LOCK_WITH_A_KEY)
    async with spawner_of() as spawner:
        assert (await job(spawner, SlotIdentity(uid, uid), FIND_KEYS)).split() == ["-1", "-1", "0", "0"]


SHUT_AWAY = (
    KEYCTL
    + """
if keyctl(0, USER, 1) < 0:  # KEYCTL_GET_KEYRING_ID: locked by an earlier run's start, for good
    sys.exit(3)
assert keyctl(5, USER, 0x01010000) == 0  # KEYCTL_SETPERM: view only, so never found again
"""
)
WITHOUT_CLONE3 = """
import ctypes, os, sys, time
from daemon.worker import _spawn
# a seccomp filter that answers clone3 ENOSYS, as Docker's default profile does: the CLONE_VFORK way
X86_64, CLONE3, ENOSYS, ERRNO, ALLOW = 0xC000003E, 435, 38, 0x00050000, 0x7FFF0000
program = [(0x20, 0, 0, 4), (0x15, 0, 3, X86_64), (0x20, 0, 0, 0), (0x15, 0, 1, CLONE3),
           (0x06, 0, 0, ERRNO | ENOSYS), (0x06, 0, 0, ALLOW)]  # ld arch; jeq; ld nr; jeq; ret; ret
class Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint)]
class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]
filters = (Filter * len(program))(*program)
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(22, 2, ctypes.byref(Program(len(program), filters)), 0, 0) == 0  # PR_SET_SECCOMP
uid = int(sys.argv[1])
began = time.monotonic()
pid, pidfd = _spawn.spawn([b"/bin/true"], [b"true"], [], b"/", 0, 1, uid, uid, -1, False, -100, [],
                          False, False)
waited = time.monotonic() - began
print(round(waited, 3), *_spawn.reap(pid, pidfd, True))
"""


@pytest.mark.skipif(
    os.uname().machine != "x86_64", reason="clone3 refused stands for the other architectures"
)
async def test_where_the_worker_waits_for_a_start_a_keyring_never_found_holds_it_up_briefly() -> None:
    """issue 44 item 7: where the calling thread waits for the child's exec (CLONE_VFORK: off
    x86-64, or where a seccomp filter refuses clone3), a start that waits for the kernel to replace
    its uid's keyring holds up the worker's event loop as long. The kernel replaces one in an RCU
    grace period (~10 ms, 48 ms at most of 1 500 here), so such a start gives up after ~200 ms, not
    5 s. Here the uid itself left its user keyring unsearchable, which no start can repair."""
    uid = a_uid_left_so(SHUT_AWAY)
    started = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WITHOUT_CLONE3, str(uid), stdout=subprocess.PIPE, cwd=Path(__file__).parents[3]
    )
    out, _ = await asyncio.wait_for(started.communicate(), 30)
    waited, status, error, *step = out.decode().split(maxsplit=3)
    assert (int(status), int(error)) == (127, errno.ENOKEY), step
    assert float(waited) < 1.5


MQ = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
SYSV_KEY = 0x6770_6f6c
def mq(flags, mode=0o666):
    q = libc.mq_open(b"/gpupool-test-queue", flags, mode, None)
    return "found" if q >= 0 else os.strerror(ctypes.get_errno())
def msg(flags):
    return "found" if libc.msgget(SYSV_KEY, flags) >= 0 else os.strerror(ctypes.get_errno())
"""
MAKE_QUEUES = MQ + "print(mq(os.O_CREAT | os.O_RDWR), msg(0o1666), flush=True); time.sleep({hold})\n"
FIND_QUEUES = MQ + "print(mq(os.O_RDONLY), msg(0o666), sep='  ', end='')\n"
NOT_FOUND = os.strerror(errno.ENOENT)


async def test_a_jobs_message_queues_reach_neither_a_job_beside_it_nor_the_next() -> None:
    """issue 44 item 7: POSIX message queues and System V objects are the IPC namespace's; in the
    machine's, a queue made 0666 by one job was open to every other, and the POSIX ones outlived
    it (where /dev/mqueue is not mounted, nothing could sweep them)."""
    async with spawner_of() as spawner:
        maker = spawner.spawn(
            ["python3", "-c", MAKE_QUEUES.format(hold=30)], cwd=Path("/"), env=ENV, identity=ALICE
        )
        with os.fdopen(maker.output, "rb") as made:
            assert made.readline().split() == [b"found", b"found"]
            try:  # beside it, as another uid
                assert (await job(spawner, BOB, FIND_QUEUES)).split("  ") == [NOT_FOUND, NOT_FOUND]
            finally:
                os.killpg(maker.pid, 9)
                await asyncio.wait_for(maker.wait(), 30)
        # after it, as its own uid
        assert (await job(spawner, ALICE, FIND_QUEUES)).split("  ") == [NOT_FOUND, NOT_FOUND]


async def test_a_jobs_lock_files_go_with_it() -> None:
    """issue 44 item 7: /run/lock is writable by every uid, like /tmp: what a job left there
    reached the next job of its uid."""
    lock = Path("/run/lock/gpupool-test-lock")
    lock.unlink(missing_ok=True)
    async with spawner_of() as spawner:
        await job(spawner, ALICE, f"open({str(lock)!r}, 'w').write('alice')")
        assert not lock.exists()


LISTEN = """
import socket, time
tcp = socket.socket(); tcp.bind(("127.0.0.1", 0)); tcp.listen()
unix = socket.socket(socket.AF_UNIX); unix.bind(b"\\0gpupool-test-socket"); unix.listen()
print(tcp.getsockname()[1], flush=True)
time.sleep(30)
"""
CONNECT = """
import socket, sys
def reach(family, address):
    try:
        socket.socket(family).connect(address)
        return "reached"
    except OSError as exc:
        return type(exc).__name__
own = socket.socket(); own.bind(("127.0.0.1", 0)); own.listen()  # its own loopback works
print(reach(socket.AF_INET, ("127.0.0.1", int(sys.argv[1]))),
      reach(socket.AF_UNIX, b"\\0gpupool-test-socket"), reach(socket.AF_INET, own.getsockname()))
"""


@pytest.mark.parametrize(("network", "reached"), [("host", "reached"), ("private", "ConnectionRefusedError")])
async def test_with_a_private_network_a_job_reaches_no_other_jobs_sockets(network: str, reached: str) -> None:
    """issue 44 item 7: loopback ports and abstract unix sockets are the network namespace's; on
    the host's network (the default) every job reaches every other's (Jupyter, Ray,
    torch.distributed); `job_network = "private"` gives each its own, loopback up."""
    async with spawner_of(Confinement(network)) as spawner:
        listener = spawner.spawn(["python3", "-c", LISTEN], cwd=Path("/"), env=ENV, identity=ALICE)
        with os.fdopen(listener.output, "rb") as listening:
            port = int(listening.readline())
            try:
                child = spawner.spawn(
                    ["python3", "-c", CONNECT, str(port)], cwd=Path("/"), env=ENV, identity=BOB
                )
                out = await asyncio.to_thread(read_all, child.output)
                assert await asyncio.wait_for(child.wait(), 30) == 0, out
            finally:
                os.killpg(listener.pid, 9)
                await asyncio.wait_for(listener.wait(), 30)
    assert out.split() == [reached, reached, "reached"]


async def test_an_exec_in_a_job_with_a_private_network_reaches_the_jobs_loopback() -> None:
    """Issue 49, review finding 6: a command run inside a running job (spawn_in_job) joins the
    job's network and IPC namespaces; with `job_network = "private"` it made new ones, and could
    not reach what the job serves on its loopback (a Jupyter, a TensorBoard) nor its abstract
    unix sockets."""
    async with spawner_of(Confinement("private")) as spawner:
        listener = spawner.spawn(["python3", "-c", LISTEN], cwd=Path("/"), env=ENV, identity=ALICE)
        with os.fdopen(listener.output, "rb") as listening:
            port = int(listening.readline())
            try:
                child = spawner.spawn_in_job(
                    ["python3", "-c", CONNECT, str(port)], cwd=Path("/"), env=ENV, identity=ALICE,
                    cgroup=None, gpus=(), stdin=None, job=listener,
                )  # fmt: skip
                os.close(child.errors)
                out = await asyncio.to_thread(read_all, child.output)
                assert await asyncio.wait_for(child.wait(), 30) == 0, out
            finally:
                os.killpg(listener.pid, 9)
                await asyncio.wait_for(listener.wait(), 30)
    assert out.split() == ["reached", "reached", "reached"]


CAP_SYS_ADMIN = 21


@contextlib.contextmanager
def without_capability(cap: int) -> Iterator[None]:
    """This thread (the event loop's, which makes the jobs' processes) without `cap` in its
    effective set, as a worker whose unit does not give it; restored after."""
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: two words each
    assert libc.capget(header, data) == 0
    saved = list(data)
    data[0] &= ~(1 << cap)
    assert libc.capset(header, data) == 0, os.strerror(ctypes.get_errno())
    try:
        yield
    finally:
        data[:] = saved
        assert libc.capset(header, data) == 0


async def test_a_step_refused_fails_the_start_saying_which() -> None:
    """issue 44 items 4 and 7: each step of the confinement that fails fails the job's start,
    saying which step (never a job run unconfined); the program was never run."""
    async with spawner_of() as spawner:
        with without_capability(CAP_SYS_ADMIN):
            child = spawner.spawn(
                ["touch", "/run/lock/gpupool-never"], cwd=Path("/"), env=ENV, identity=ALICE
            )
        assert await asyncio.wait_for(child.wait(), 30) == 127
        os.close(child.output)
    assert child.start_error is not None
    assert child.start_error.errno == errno.EPERM
    assert child.start_error.strerror == "Operation not permitted (making namespaces of its own)"
    assert not Path("/run/lock/gpupool-never").exists()


async def test_a_worker_that_cannot_confine_its_jobs_refuses_to_start(queue: JobQueue) -> None:
    """issue 44 items 4 and 7: a root worker without CAP_SYS_ADMIN (the unit of before) would fail
    every job it took: it refuses to start, saying what it needs."""
    with without_capability(CAP_SYS_ADMIN), pytest.raises(IdentityError, match="CAP_SYS_ADMIN"):
        async with hardened_worker(queue):
            pass


async def test_a_private_network_without_uids_of_its_own_is_refused(queue: JobQueue, tmp_path: Path) -> None:
    """issue 44 item 7: a job running as the worker's user (or root) cannot be given a network of
    its own that it could not leave: a worker asked for one refuses to start, saying what it needs."""
    with pytest.raises(IdentityError, match="job_uid_range"):
        async with running_worker(queue, tmp_path / "w", job_network="private"):
            pass


@pytest.mark.parametrize(
    ("hidden", "own_ipc", "own_net"), [([b"/dev/nvidia0"], False, False), ([], True, True)]
)
def test_the_c_module_confines_only_a_job_with_a_uid(
    hidden: list[bytes], own_ipc: bool, own_net: bool
) -> None:
    """A job running as the worker's user (or as root, which would undo it) is given no
    namespace: the C module refuses the request before any process is made."""
    with pytest.raises(ValueError, match="need a uid"):
        _spawn.spawn(
            [b"/bin/true"], [b"true"], [], b"/", 0, 1, -1, -1, -1, False, -100, hidden, own_ipc, own_net
        )


KEEP_A_KEY = (
    KEYCTL
    + """
import time
print(persistent >= 0 and add(persistent, b"alice-p") > 0, flush=True)
time.sleep(30)
"""
)


async def test_an_exec_in_a_running_job_leaves_its_keyrings_as_the_job_has_them() -> None:
    """Issue 49, review finding 7: a command run inside a running job (`poolctl exec`,
    spawn_in_job) emptied the job's persistent keyring, as a job's own start does; it now leaves
    the job's keyrings alone: the key the job put there is still there for it."""
    uid = fresh_uid()
    slot = SlotIdentity(uid, uid)
    async with spawner_of() as spawner:
        running = spawner.spawn(["python3", "-c", KEEP_A_KEY], cwd=Path("/"), env=ENV, identity=slot, gpus=())
        try:
            with os.fdopen(running.output, "rb") as said:
                kept = await asyncio.wait_for(asyncio.to_thread(said.readline), 30)
                if kept != b"True\n":
                    pytest.skip(f"this kernel has no persistent keyrings ({kept!r})")
                find = KEYCTL + "print(keys(persistent))"
                execd = spawner.spawn_in_job(
                    ["python3", "-c", find],
                    cwd=Path("/"),
                    env=ENV,
                    identity=slot,
                    cgroup=None,
                    gpus=(),
                    stdin=None,
                    job=running,
                )
                os.close(execd.errors)
                assert await asyncio.to_thread(read_all, execd.output) == "1\n"
                assert await asyncio.wait_for(execd.wait(), 30) == 0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(running.pid, signal.SIGKILL)
            await asyncio.wait_for(running.wait(), 30)


async def test_a_forwards_connection_into_a_job_is_made_as_the_jobs_uid() -> None:
    """Issue 49, review finding 10: a forward's connection to a port inside a job was made by the
    root worker, so the host's rules by uid (an owner match in its firewall) never applied to it;
    it is made as the job's uid, as the job's own sockets are (the kernel's socket table says)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        ours = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        with await connect_in_job(ours, listener.getsockname()[1], ALICE) as made:
            local = f"0100007F:{made.getsockname()[1]:04X}"
            remote = f"0100007F:{listener.getsockname()[1]:04X}"
            with open("/proc/net/tcp") as table:  # this connection, established (not a TIME_WAIT
                rows = [line.split() for line in table]  # of another's, root's, on the same port)
            owners = [row[7] for row in rows if row[1:4] == [local, remote, "01"]]
    assert owners == [str(ALICE.uid)]
