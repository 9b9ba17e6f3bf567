"""Interactive work's costs (issue 49): a keystroke's echo and a forwarded port's throughput through
the pool's relay, beside a direct TCP connection and `ssh` to a private sshd, one machine, one run.

One job runs on a single-machine pool (`poold` as `make run` starts it: bench/common.py
`local_pool`, spoken to over its TCP listener on loopback, as a user on another machine would,
less TLS) and serves a TCP port on its loopback: JOB_SERVER, which echoes what it is sent, or
sends or takes N bytes, as the first line of each connection asks.

Keystroke echo, ms (p50, p99, max): one byte sent, the next only once it came back, through
- direct: a TCP connection to the job's server on loopback (the floor: two hops in the kernel);
- ssh -L: an `ssh -N -L` tunnel to the private sshd, to the same server;
- ssh cat: `ssh HOST cat`, its stdin and stdout pipes here (a remote command's path, no PTY);
- gpupool exec: `cat` in the job over a channel, `PoolClient.channel` in this process, as
  `poolctl exec JOB -- cat` runs with its stdin piped;
- gpupool forward: `poolctl forward JOB 0:PORT` (a process of its own, as a user runs it), to the
  same server;
- gpupool attach (PTY): a second job on a terminal (a `tty` job, as `poolctl shell` starts one),
  `stty raw -echo; exec cat` (as a shell's line editor, the program echoes each key, not the
  terminal), attached over a channel of kind "attach" in this process; where the pool has no
  tty jobs (its server refuses the job), its row says so.
`--keys` keystrokes each, in `--rounds` rounds: each round every path in turn (the order turning),
so that the machine's drift reaches all alike; each connection is opened once, and its first
WARM keystrokes (its set-up) are not counted.

Forwarded throughput, MiB/s (median of `--transfers`): `--size` MiB from the job's server to here
(download: request -> last byte) and from here to it (upload: first byte -> the server's word that
it has them all), through direct, ssh -L and gpupool forward; a new connection for each transfer
(as a browser's), one transfer of each path a round, the order turning.

Relay CPU: the CPU time (user and system, from /proc, in clock ticks of 10 ms: read it at the
full sizes) that the processes between the two ends used, a keystroke (µs) or a MiB moved (ms),
by process: gpupool's poold (its server and its worker, one process as `make run` starts it),
its redis-server and `poolctl forward`; ssh's client and sshd. Neither end counts (this process,
the job's server, `cat`), nor what the relay uses with nothing to relay (measured over `idle`
seconds before the keystrokes, with every connection open, and subtracted): where the time of a
slow route goes, and what a busier machine would take from it.

The ssh rows go through a private sshd on loopback (bench/private_sshd.py: Debian's
openssh-server, a config and keys of its own, OpenSSH's defaults); where sshd is not installed, or
does not start, they say why and the rest runs.

Its parts: this module has the routes, the pool's jobs, the measures, the summary and the tables;
bench/echoes.py the paths a keystroke takes (one open connection each, timed a byte at a time);
bench/relay_cpu.py what a route's relay costs (its processes by role, their CPU as snapshots);
bench/private_sshd.py the private sshd; bench/common.py the pool, free ports, bounded waits.

Every wait is bounded (bench/common.py `STEP_LIMIT`). Prints the tables, then the result as one
JSON line; writes bench/results/interactive.json.
`python -m bench.interactive [--quick] [--keys N] [--size MIB]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil
import uvloop
from rich.console import Console
from rich.table import Table

from bench.common import (
    STEP_LIMIT,
    accepting,
    bounded,
    free_port,
    local_pool,
    machine,
    median,
    percentile,
    ready,
    save,
    stop,
)
from bench.echoes import ChannelEcho, Echo, PipeEcho, StreamEcho
from bench.private_sshd import Ssh, private_sshd
from bench.relay_cpu import Cpu, Roles, Snapshot, pool_roles, snapshot, ssh_roles, used_between
from daemon import tokens
from daemon.client.pool_client import ClientError, PoolClient
from protocol import CancelJobs, Cancelled, Enqueue, Enqueued, JobDetail, OpenChannel, ShowJob, WaitJobs

WARM = 5  # keystrokes a connection makes before those counted: its set-up, its first round trips
CHUNK = 1 << 20  # bytes a transfer writes or reads at a time
MIB = 1 << 20

# The job's TCP server, run by /usr/bin/python3 (any uid can): each connection's first line says
# what it wants: "echo" (what it is sent, sent back), "send N" (N bytes, then the end), "recv N"
# (N bytes taken, then "ok\n"). A thread a connection; a probe that says nothing is let go.
JOB_SERVER = r"""
import socket, sys, threading
BLOCK = bytes(1 << 20)
def line(conn):
    said = b""
    while not said.endswith(b"\n"):
        byte = conn.recv(1)
        if not byte:
            return b""
        said += byte
    return said.strip()
def serve(conn):
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        what, _, size = line(conn).partition(b" ")
        if what == b"echo":
            while data := conn.recv(65536):
                conn.sendall(data)
        elif what == b"send":
            left = int(size)
            while left:
                left -= conn.send(memoryview(BLOCK)[: min(left, len(BLOCK))])
            conn.shutdown(socket.SHUT_WR)
            conn.recv(1)
        elif what == b"recv":
            left, room = int(size), bytearray(1 << 20)
            while left and (got := conn.recv_into(room)):
                left -= got
            conn.sendall(b"ok\n")
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", int(sys.argv[1])))
listener.listen(64)
print("serving", flush=True)
while True:
    conn, _ = listener.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""

ECHO_PATHS = ("direct", "ssh -L", "ssh cat", "gpupool exec", "gpupool forward", "gpupool attach (PTY)")
TRANSFER_PATHS = ("direct", "ssh -L", "gpupool forward")
PTY_JOB = ["sh", "-c", "stty raw -echo && exec cat"]  # each key read at once and echoed by the program


# --- a route: its echo, its port, its relay ------------------------------------------------------

Samples = dict[str, list[float]]


@dataclass
class Route:
    """One way to reach the job's server (or an echoing command): its echo, its port for transfers
    (None: no transfers through it), and the processes of its relay, with the CPU they use a second
    with nothing to relay (`idle`: timers, heartbeats, blocking reads that time out)."""

    name: str
    echo: Echo | None
    port: int | None
    roles: Roles
    idle: Cpu = field(default_factory=dict)

    async def key(self) -> float:
        assert self.echo is not None
        return await self.echo.key()

    def cpu(self) -> Snapshot:
        """CPU seconds each of the relay's processes has used so far, by role."""
        return snapshot(self.roles)

    @contextlib.contextmanager
    def metered(self, total: Cpu) -> Iterator[None]:
        """Add to `total` the CPU the relay used within the block, less what it uses idle."""
        before, began = self.cpu(), time.monotonic()
        yield
        elapsed = time.monotonic() - began
        for role, used in used_between(before, self.cpu()).items():
            total[role] = total.get(role, 0.0) + used - self.idle.get(role, 0.0) * elapsed


async def measure_idle(routes: list[Route], seconds: float) -> None:
    """Each route's `idle`: its relay's CPU over `seconds` with nothing to relay."""
    before, began = [route.cpu() for route in routes], time.monotonic()
    await asyncio.sleep(seconds)
    elapsed = time.monotonic() - began
    for route, was in zip(routes, before, strict=True):
        route.idle = {role: used / elapsed for role, used in used_between(was, route.cpu()).items()}


# --- the routes through the private sshd ---------------------------------------------------------


async def ssh_tunnel(ssh: Ssh, port: int) -> tuple[asyncio.subprocess.Process, int]:
    """`ssh -N -L LOCAL:127.0.0.1:PORT`, accepting on LOCAL."""
    local = free_port()
    proc = await asyncio.create_subprocess_exec(
        *ssh.args[:1], "-N", "-o", "ExitOnForwardFailure=yes", "-L", f"{local}:127.0.0.1:{port}",
        *ssh.args[1:],
        stdin=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        await accepting(
            local, "ssh -L", lambda: None if proc.returncode is None else f"exit {proc.returncode}"
        )
    except BaseException:
        await stop(proc)
        raise
    return proc, local


async def ssh_routes(ssh: Ssh, port: int, astack: contextlib.AsyncExitStack) -> list[Route]:
    """The routes through the private sshd to the job's server (`port`): `ssh -L` to it and `ssh
    HOST cat`, each seen to echo a key (their echoes closed on the way out)."""
    sshd = psutil.Process(ssh.pid)
    tunnel, local = await ssh_tunnel(ssh, port)
    astack.push_async_callback(stop, tunnel)
    cat = await asyncio.create_subprocess_exec(
        *ssh.args, "-T", "cat", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
    )
    astack.push_async_callback(stop, cat)
    routes = [
        Route("ssh -L", await StreamEcho.open(local), local, ssh_roles(tunnel, sshd)),
        Route("ssh cat", PipeEcho(cat), None, ssh_roles(cat, sshd)),
    ]
    for route in routes:
        assert route.echo is not None
        astack.push_async_callback(route.echo.close)
        await route.key()  # it answers, or the rows say why not
    return routes


# --- the pool -----------------------------------------------------------------------------------


async def serving_job(client: PoolClient, port: int) -> str:
    """A job serving JOB_SERVER on `port`, running; its id."""
    spec = {"argv": ["/usr/bin/python3", "-u", "-c", JOB_SERVER, str(port)], "name": "bench-interactive"}
    job_id = (await client.call(Enqueue(spec, None), Enqueued)).job_id

    async def why_not() -> str | None:
        state = (await client.call(ShowJob(job_id), JobDetail)).job["state"]
        return None if state in ("queued", "running") else f"job {job_id} is {state}"

    deadline = time.monotonic() + STEP_LIMIT
    while (why := await why_not()) is None:
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return job_id
        if time.monotonic() > deadline:
            why = f"job {job_id} did not serve 127.0.0.1:{port} within {STEP_LIMIT:.0f} s"
            break
        await asyncio.sleep(0.05)
    raise RuntimeError(why)


async def tty_job(client: PoolClient) -> tuple[str | None, str]:
    """A tty job running PTY_JOB: (its id, ""); or (None, why the pool runs none)."""
    spec = {"argv": PTY_JOB, "name": "bench-interactive-pty", "tty": True}
    try:
        job_id = (await client.call(Enqueue(spec, None), Enqueued)).job_id
    except ClientError as exc:  # a server of before `poolctl shell`: "tty" is no field of its jobs
        return None, f"no tty jobs on this pool ({exc})"
    async with asyncio.timeout(STEP_LIMIT):
        # polled: the pool tells of a job's end (WaitJobs), not of its start
        while (state := (await client.call(ShowJob(job_id), JobDetail)).job["state"]) == "queued":  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    if state != "running":
        raise RuntimeError(f"the tty job {job_id} is {state}")
    return job_id, ""


async def cancel(client: PoolClient, job_id: str) -> None:
    """Cancel the job and wait for its end."""
    await client.call(CancelJobs([job_id]), Cancelled)
    async with asyncio.timeout(STEP_LIMIT):
        async for _ in client.stream(WaitJobs([job_id], None)):  # its end, then the final reply
            pass


async def poolctl_forward(job_id: str, port: int) -> tuple[asyncio.subprocess.Process, int]:
    """`poolctl forward JOB 0:PORT` running, with the local port it printed."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "daemon.ctl.cli", "forward", job_id, f"0:{port}",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    line = (await bounded("poolctl forward", proc.stdout.readline())).decode()
    if not (found := re.match(r"forwarding 127\.0\.0\.1:(\d+) ", line)):
        await stop(proc)
        raise RuntimeError(f"poolctl forward said {line!r}")
    return proc, int(found[1])


# --- the measures -------------------------------------------------------------------------------


async def keystrokes(routes: list[Route], keys: int, rounds: int) -> tuple[Samples, dict[str, Cpu]]:
    """`keys` round trips through each route's echo, in `rounds` rounds, the order turning; with
    the CPU its relay used for them."""
    echoing = [route for route in routes if route.echo is not None]
    for route in echoing:
        for _ in range(WARM):
            await route.key()
    times: Samples = {route.name: [] for route in echoing}
    cpu: dict[str, Cpu] = {route.name: {} for route in echoing}
    for r in range(rounds):
        share = keys // rounds + (1 if r < keys % rounds else 0)
        for route in echoing[r % len(echoing) :] + echoing[: r % len(echoing)]:
            with route.metered(cpu[route.name]):
                times[route.name] += [await route.key() for _ in range(share)]
    return times, cpu


async def download(port: int, size: int) -> float:
    """Seconds from asking for `size` bytes to the last of them."""
    reader, writer = await bounded("connect", asyncio.open_connection("127.0.0.1", port))
    try:
        began = time.perf_counter()
        writer.write(f"send {size}\n".encode())
        left = size
        async with asyncio.timeout(STEP_LIMIT + size / MIB):  # 1 MiB/s at the least
            while left > 0:
                data = await reader.read(CHUNK)
                if not data:
                    raise RuntimeError(f"the download ended {left} bytes short")
                left -= len(data)
        return time.perf_counter() - began
    finally:
        writer.close()


async def upload(port: int, size: int) -> float:
    """Seconds from the first of `size` bytes sent to the server's word that it has them all."""
    reader, writer = await bounded("connect", asyncio.open_connection("127.0.0.1", port))
    block = bytes(CHUNK)
    try:
        began = time.perf_counter()
        writer.write(f"recv {size}\n".encode())
        async with asyncio.timeout(STEP_LIMIT + size / MIB):
            for start in range(0, size, CHUNK):
                writer.write(block[: min(CHUNK, size - start)])
                await writer.drain()
            if await reader.readline() != b"ok\n":
                raise RuntimeError("the upload was not taken whole")
        return time.perf_counter() - began
    finally:
        writer.close()


async def transfers(
    routes: list[Route], size: int, count: int
) -> tuple[dict[str, Samples], dict[str, dict[str, Cpu]]]:
    """`count` downloads and uploads of `size` bytes through each route's port, MiB/s, the order
    turning; with the CPU its relay used for them."""
    moving = [route for route in routes if route.port is not None]
    rates: dict[str, Samples] = {route.name: {"download": [], "upload": []} for route in moving}
    cpu: dict[str, dict[str, Cpu]] = {route.name: {"download": {}, "upload": {}} for route in moving}
    for r in range(count):
        for route in moving[r % len(moving) :] + moving[: r % len(moving)]:
            assert route.port is not None
            for way, move in (("download", download), ("upload", upload)):
                with route.metered(cpu[route.name][way]):
                    rates[route.name][way].append(size / MIB / await move(route.port, size))
    return rates, cpu


@dataclass
class Sizes:
    keys: int
    rounds: int
    size: int  # bytes a transfer
    transfers: int
    idle: float = 2.0  # seconds the relays' idle CPU is measured over


async def measure(tmp: Path, sizes: Sizes) -> dict[str, Any]:
    skipped: dict[str, str] = {}
    routes: list[Route] = []
    listen = f"127.0.0.1:{free_port()}"
    task = asyncio.current_task()
    assert task is not None
    # A SIGTERM (`timeout`'s) ends the run as Ctrl-C does: every child stopped on the way out.
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    with contextlib.ExitStack() as stack:
        proc = stack.enter_context(local_pool(tmp, GPUPOOL_LISTEN=listen))
        ssh = stack.enter_context(private_sshd(tmp / "ssh"))  # starts while poold does
        ready(proc, tmp)
        poold = psutil.Process(proc.pid)
        os.environ["GPUPOOL_SERVER"] = listen  # for poolctl forward: the TCP listener, as ours
        async with contextlib.AsyncExitStack() as astack:
            client = PoolClient(listen, tokens.local_user(), tokens.client_token())
            await client.connect()
            astack.push_async_callback(client.close)
            port = free_port()
            job_id = await serving_job(client, port)
            astack.push_async_callback(cancel, client, job_id)  # else poold's stop waits for it

            def add(route: Route) -> None:
                routes.append(route)
                if route.echo is not None:  # closed before what it goes through
                    astack.push_async_callback(route.echo.close)

            add(Route("direct", await StreamEcho.open(port), port, dict))
            if isinstance(ssh, str):
                skipped["ssh -L"] = skipped["ssh cat"] = ssh
            else:
                try:
                    routes += await ssh_routes(ssh, port, astack)
                except (OSError, RuntimeError, TimeoutError, asyncio.IncompleteReadError) as exc:
                    skipped["ssh -L"] = skipped["ssh cat"] = f"ssh did not answer: {exc}"
            exec_cat = ChannelEcho(client, OpenChannel(job_id, "exec", ["cat"], stdin=True))
            add(Route("gpupool exec", exec_cat, None, pool_roles(poold)))
            forward, local = await poolctl_forward(job_id, port)
            astack.push_async_callback(stop, forward)
            forwarded = await StreamEcho.open(local)
            add(Route("gpupool forward", forwarded, local, pool_roles(poold, forward)))
            pty, why = await tty_job(client)
            if pty is None:
                skipped["gpupool attach (PTY)"] = why
            else:
                astack.push_async_callback(cancel, client, pty)
                attached = ChannelEcho(client, OpenChannel(pty, "attach", [], stdin=True), detach=True)
                add(Route("gpupool attach (PTY)", attached, None, pool_roles(poold)))
            await measure_idle(routes, sizes.idle)
            keys, keys_cpu = await keystrokes(routes, sizes.keys, sizes.rounds)
            rates, rates_cpu = await transfers(routes, sizes.size, sizes.transfers)
    return {
        "keystrokes": keys,
        "keystrokes_cpu": keys_cpu,
        "rates": rates,
        "rates_cpu": rates_cpu,
        "idle_cpu": {route.name: route.idle for route in routes},
        "skipped": skipped,
        "size_mib": sizes.size / MIB,
    }


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return "unknown"


def summary(raw: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    """Each route's p50/p99/max echo and the CPU its relay used a keystroke (µs, by role); its
    median rates each way and the CPU its relay used a MiB (ms, by role); or why it was skipped."""
    echo: dict[str, Any] = {}
    for name in ECHO_PATHS:
        if (seconds := raw["keystrokes"].get(name)) is not None:
            ms = [s * 1000 for s in seconds]
            cpu = {role: used / len(ms) * 1e6 for role, used in raw["keystrokes_cpu"][name].items()}
            echo[name] = {
                "n": len(ms),
                "p50_ms": percentile(ms, 50),
                "p99_ms": percentile(ms, 99),
                "max_ms": max(ms),
                "cpu_us_a_key": sum(cpu.values()),
                "cpu_us_a_key_by": cpu,
            }
        else:
            echo[name] = {"skipped": raw["skipped"][name]}
    throughput: dict[str, Any] = {}
    moved = raw["size_mib"] * sizes.transfers
    for name in TRANSFER_PATHS:
        if (rates := raw["rates"].get(name)) is not None:
            row: dict[str, Any] = {"transfers": sizes.transfers}
            for way, rate in rates.items():
                cpu = {role: used / moved * 1000 for role, used in raw["rates_cpu"][name][way].items()}
                row |= {f"{way}_mib_s": median(rate), f"{way}_cpu_ms_a_mib": sum(cpu.values())}
                row[f"{way}_cpu_ms_a_mib_by"] = cpu
            throughput[name] = row
        else:
            throughput[name] = {"skipped": raw["skipped"][name]}
    return {
        "machine": {**machine(), "cpu": cpu_model()},
        "sizes": {"keys": sizes.keys, "rounds": sizes.rounds, "size_mib": raw["size_mib"], "warm": WARM},
        # what each relay used a second with nothing to relay, subtracted from the rest (%)
        "idle_cpu_percent": {
            name: {role: used * 100 for role, used in idle.items()} for name, idle in raw["idle_cpu"].items()
        },
        "keystroke_echo": echo,
        "forwarded_throughput": throughput,
    }


def by_role(used: dict[str, float], digits: int) -> str:
    """`used` as "poold 12 + redis-server 3" (the roles that used any)."""
    return " + ".join(f"{role} {value:.{digits}f}" for role, value in used.items()) or "-"


def tables(result: dict[str, Any]) -> tuple[Table, Table]:
    m, s = result["machine"], result["sizes"]
    echo = Table(
        title=f"keystroke echo, one byte at a time, {s['keys']} each (ms): {m['cpu']}, {m['nproc']} CPUs, "
        f"{m['date']}"
    )
    for column in ("path", "p50", "p99", "max", "p50 / direct's", "relay CPU a keystroke, µs", "note"):
        echo.add_column(column)
    direct = result["keystroke_echo"]["direct"]["p50_ms"]
    for name, row in result["keystroke_echo"].items():
        if "skipped" in row:
            echo.add_row(name, "-", "-", "-", "-", "-", row["skipped"])
        else:
            ratio = f"{row['p50_ms'] / direct:.1f}x"
            cpu = by_role(row["cpu_us_a_key_by"], 0)
            echo.add_row(
                name, f"{row['p50_ms']:.3f}", f"{row['p99_ms']:.3f}", f"{row['max_ms']:.3f}", ratio, cpu, ""
            )
    rate = Table(title=f"forwarded throughput, {s['size_mib']:g} MiB a transfer (MiB/s, medians)")
    for column in ("path", "download", "upload", "download / direct's", "relay CPU a MiB down, ms", "note"):
        rate.add_column(column)
    floor = result["forwarded_throughput"]["direct"]["download_mib_s"]
    for name, row in result["forwarded_throughput"].items():
        if "skipped" in row:
            rate.add_row(name, "-", "-", "-", "-", row["skipped"])
        else:
            down, up = row["download_mib_s"], row["upload_mib_s"]
            cpu = by_role(row["download_cpu_ms_a_mib_by"], 1)
            rate.add_row(name, f"{down:.0f}", f"{up:.0f}", f"{down / floor:.2f}", cpu, "")
    return echo, rate


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys", type=int, default=1000, help="keystrokes through each path (default 1000)")
    p.add_argument("--rounds", type=int, default=5, help="rounds the keystrokes are split into (default 5)")
    p.add_argument("--size", type=int, default=64, help="MiB a transfer (default 64)")
    p.add_argument(
        "--transfers", type=int, default=5, help="transfers each way through each path (default 5)"
    )
    p.add_argument("--quick", action="store_true", help="20 keystrokes in 2 rounds, 2 transfers of 1 MiB")
    args = p.parse_args(argv)
    sizes = (
        Sizes(20, 2, MIB, 2, idle=0.2)
        if args.quick
        else Sizes(args.keys, args.rounds, args.size * MIB, args.transfers)
    )
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-interactive-") as tmp_name:
        tmp = Path(tmp_name)
        tmp.chmod(0o711)  # poold checks that a job's uid could pass through it to data/worker
        (tmp / "ssh").mkdir(mode=0o700)
        raw = uvloop.run(measure(tmp, sizes))
    result = summary(raw, sizes)
    save("interactive", {**result, "raw": raw})
    console = Console(width=140)
    for table in tables(result):
        console.print(table)
    print(orjson.dumps(result).decode())


if __name__ == "__main__":
    main()
