"""Issue 49: a channel's relay through Redis, its speed and its ends, end to end: a real pool
server, a real `poold --worker` running jobs as slot uids (test_exec.py's), and `poolctl` as a
subprocess."""

from __future__ import annotations

import asyncio
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from daemon.queue import channels
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.server.relay_budget import RelayBudget
from tests.daemon.ctl.test_exec import log_text, running_job
from tests.daemon.ctl.test_forward import forwarding, free_port
from tests.support.paths import ROOT
from tests.support.poolctl import poolctl
from tests.support.proxy import Proxy
from tests.support.workers import wait_until

FAR = 0.1  # seconds each Redis reply takes to reach the worker: a Redis a network away
OUTPUT = 2**20  # 16 entries of output, 4 windows


@contextmanager
def far_redis(redis_server: EmbeddedRedis) -> Iterator[Proxy]:
    """A proxy to `redis_server` on a loop of its own (the worker's teardown blocks the test's)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    proxy = Proxy(redis_server.port)
    asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(10)
    try:
        yield proxy
    finally:
        asyncio.run_coroutine_threadsafe(proxy.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def test_output_moves_more_than_an_entry_per_round_trip(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    """Issue 49, the relay's speed (forwarded throughput): a worker whose Redis answers FAR late
    relays 1 MiB of an exec's output (16 entries) in less than a round trip per entry: it writes
    its entries without waiting for Redis between them (deletes ride with them), and the server
    acknowledges what it takes at once, in a write it does not wait for. (A worker that waited
    for each append, and a server that acknowledged only after sending, took ~2.4 s here.)"""
    with far_redis(redis_server) as proxy:
        job = running_job(redis_server, tmp_path, s3_env, worker_options=("--redis-port", str(proxy.port)))
        async with job as (pool, job_id, _):
            proxy.delay(FAR)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "daemon.ctl.cli", "exec", job_id, "--",
                "head", "-c", str(OUTPUT), "/dev/zero",
                env={**pool.env("alice"), "PYTHONPATH": str(ROOT)}, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            assert proc.stdout is not None
            first = await asyncio.wait_for(proc.stdout.read(1), 30)
            began = time.monotonic()
            rest = await asyncio.wait_for(proc.stdout.read(), 30)
            took = time.monotonic() - began
            proxy.delay(0)
            assert await asyncio.wait_for(proc.wait(), 10) == 0
            assert len(first + rest) == OUTPUT
            entries = OUTPUT // channels.READ_CHUNK
            print(f"{OUTPUT >> 20} MiB in {took:.2f} s with Redis {FAR * 1000:g} ms away", file=sys.stderr)
            assert took < entries * FAR, f"{took:.2f} s: a round trip per entry or more"


# A job's server: "REQUEST" then the request to its end (the client half-closes), answered; or
# "ANSWER" answered at once and its side shut, then what the client sends to its end, counted.
HALVES = r"""
import socket, sys, threading
answer = b"".join(b"%d\n" % n for n in range(1, 50001))
def serve(c):
    f = c.makefile("rb")
    if f.readline().strip() == b"REQUEST":
        c.sendall(b"got %d\n" % len(f.read()) + answer)
        c.close()
    else:
        c.sendall(answer)
        c.shutdown(socket.SHUT_WR)
        print("after its end, got", len(f.read()), flush=True)
        c.close()
s = socket.create_server(("127.0.0.1", int(sys.argv[1])))
print("ready", flush=True)
while True:
    threading.Thread(target=serve, args=(s.accept()[0],)).start()
"""
ANSWER = b"".join(b"%d\n" % n for n in range(1, 50001))  # 289 KiB: more than a window


async def test_a_forward_relays_each_direction_to_its_own_end(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    """Issue 49, review finding 12: a forward's connection ends when both directions have, not
    when one has. HTTP/1.0-style, the client sends its request and shuts its write side before it
    reads: the job's server reads the request to its end and the client gets the whole answer.
    The other way, the job's server answers and shuts its write side first: the client sees the
    answer's end (EOF) and its input still reaches the job, all of it (the whole connection
    closed there, and the job's server read nothing after its end)."""
    port = free_port()
    script = Path(tempfile.mkdtemp(prefix="gpupool-halves-")) / "halves.py"
    script.write_text(HALVES)
    script.parent.chmod(0o755)
    script.chmod(0o644)
    command = f"exec /usr/bin/python3 -u {script} {port}"
    job = running_job(redis_server, tmp_path, s3_env, command=command, ready_line="ready")
    async with job as (pool, job_id, _), forwarding(pool.env("alice"), job_id, port) as (_, local):
        reader, writer = await asyncio.open_connection("127.0.0.1", local)
        writer.write(b"REQUEST\n" + b"x" * 100_000)
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 30) == b"got 100000\n" + ANSWER
        writer.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", local)
        writer.write(b"ANSWER\n")
        assert await asyncio.wait_for(reader.read(), 30) == ANSWER  # to its end: the job's side shut
        writer.write(b"y" * 300_000)
        writer.write_eof()

        async def counted() -> bool:
            return "after its end, got" in await log_text(pool.queue, job_id)

        await wait_until(counted, 10, "the job's server to count what came after its end")
        assert "after its end, got 300000\n" in await log_text(pool.queue, job_id)
        writer.close()


# Another local user's client: connects to the forward, asks, says what it reads (b'': closed at
# once, before or after its question reached it).
OTHERS = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
try:
    s.sendall(b"ANSWER\\n")
    print(repr(s.recv(100)))
except ConnectionResetError:
    print(repr(b""))
"""


async def test_a_forward_serves_only_its_own_user(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    """Issue 49, review finding 11: `poolctl forward` listens on 127.0.0.1, where any local user
    can connect; a connection from another uid (62050, a real one: the client process setuid to
    it) is closed at once, a line on stderr says so, and nothing reaches the job (its log has no
    forward line for it); the user's own connections are served."""
    port = free_port()
    script = Path(tempfile.mkdtemp(prefix="gpupool-halves-")) / "halves.py"
    script.write_text(HALVES)
    script.parent.chmod(0o755)
    script.chmod(0o644)
    command = f"exec /usr/bin/python3 -u {script} {port}"
    job = running_job(redis_server, tmp_path, s3_env, command=command, ready_line="ready")
    async with job as (pool, job_id, _), forwarding(pool.env("alice"), job_id, port) as (proc, local):
        other = await asyncio.create_subprocess_exec(
            "setpriv", "--reuid=62050", "--regid=62050", "--clear-groups",
            "/usr/bin/python3", "-c", OTHERS, str(local),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(other.communicate(), 20)
        assert (other.returncode, out) == (0, b"b''\n"), err
        assert proc.stderr is not None
        said = await asyncio.wait_for(proc.stderr.readline(), 10)
        refused = "refused a connection from uid 62050: this forward serves only its own user (uid 0)"
        assert said.decode() == f"poolctl: {refused}\n"

        reader, writer = await asyncio.open_connection("127.0.0.1", local)
        writer.write(b"ANSWER\n")
        assert await asyncio.wait_for(reader.read(), 30) == ANSWER
        writer.close()

        async def logged() -> bool:  # the job's output reaches its log in batches
            return "[gpupool] forward by alice" in await log_text(pool.queue, job_id)

        await wait_until(logged, 10, "the job to log the forward")
        assert (await log_text(pool.queue, job_id)).count("[gpupool] forward by alice") == 1


async def test_input_counts_against_its_users_relay_budget(
    redis_server: EmbeddedRedis, tmp_path: Path, s3_env: dict[str, str]
) -> None:
    """Issue 49, review finding 3's last part (the relay's bytes count against per-user limits):
    the input a client sends, which the server writes into Redis, counts against its user's
    share as output does, so one user's uploads cannot fill Redis faster than that share nor
    starve the others: 1 MiB into `cat > /dev/null` with a share of 1 MiB/s after a 256 KiB
    burst takes its ~0.75 s, and every byte of it is counted against alice."""
    async with running_job(redis_server, tmp_path, s3_env) as (pool, job_id, _):
        rate, burst, size = 2**20, 2**18, 2**20
        handlers = pool.server.handlers
        assert handlers is not None
        handlers.relay_budget = RelayBudget(rate=rate, burst=burst)
        began = time.monotonic()
        upload = b"z" * size
        code, out, err = await poolctl(
            pool.env("alice"), "exec", job_id, "--", "sh", "-c", "cat > /dev/null", stdin=upload
        )
        took = time.monotonic() - began
        assert (code, out, err) == (0, "", "")
        assert handlers.relay_budget.relayed == {"alice": size}
        assert took >= (size - burst) / rate * 0.9
