"""docs/OPERATIONS.md's multi-node setup, followed as written (issue 47 item 11).

The blocks the guide marks `<!-- doc-test: NAME -->` are read out of it and run: SeaweedFS as §3
starts it, the configuration and the bucket of §5, the server and two workers on one machine as
their units' `ExecStart=` and `Environment=` lines start them (§6, the second worker's unit made by
the guide's own `sed`). What one machine cannot keep is changed, and only that: the directories
move under the test's own (`/etc/gpupool`, `/var/lib/...`, `/etc/systemd/system`), every address is
127.0.0.1 and every port a free one, `poold` is this checkout's (`python -m daemon.main`), and the
`pip install` lines are not run (the test's venv has what they install). pool-1 and gpu-1 are two
directory trees: the server reads pool-1's configuration, the workers gpu-1's.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import psutil

from daemon.job import JobSpec, JobState
from daemon.queue.embedded_redis import EmbeddedRedis, free_port
from daemon.queue.job_queue import JobQueue
from daemon.queue.registry import list_workers
from tests.support.paths import ROOT
from tests.support.s3server import weed_binary, weed_ports
from tests.support.workers import wait_until

GUIDE = ROOT / "docs" / "OPERATIONS.md"
POOLD = "/opt/gpupool/bin/poold"
WEED_PORTS = (
    "-s3.port=9000",
    "-master.port=9333",
    "-volume.port=8080",
    "-filer.port=8888",
    "-admin.port=23646",
)


def guide_blocks() -> dict[str, str]:
    """The guide's fenced blocks marked for this test, by name."""
    found = re.findall(r"<!-- doc-test: ([\w-]+) -->\n```\w*\n(.*?)\n```", GUIDE.read_text(), re.S)
    return dict(found)


def commands(block: str) -> list[str]:
    """A shell block's commands, continuation lines joined; `pip install` lines left out."""
    return [c for c in block.replace("\\\n", " ").splitlines() if c.strip() and "pip install" not in c]


class Machine:
    """One machine of the guide, as a directory tree of the test's, on loopback."""

    def __init__(self, root: Path, ports: dict[str, int]) -> None:
        self.root = root
        self.ports = ports
        for d in ("etc", "var/lib", "units"):
            (root / d).mkdir(parents=True, exist_ok=True)

    def local(self, text: str) -> str:
        """`text` with this machine's directories, 127.0.0.1 and the test's ports."""
        # Paths as the guide writes them (not inside one already made local: so this is idempotent);
        # /var/lib/ in a quoted value and weed's own directory. A `sed` pattern (`s|PATTERN|`)
        # names the shipped unit's lines as they are: it is kept as written.
        patterns = re.findall(r"(?<=s\|)[^|]*(?=\|)", text)
        for n, pattern in enumerate(patterns):
            text = text.replace(f"s|{pattern}|", f"s|\0{n}\0|", 1)
        for old, new in (
            (r"(?<![\w.-])/etc/systemd/system", str(self.root / "units")),
            (r"(?<![\w.-])/etc/gpupool", str(self.root / "etc" / "gpupool")),
            (r'(?<=")/var/lib/|(?<![\w.-])/var/lib/(?=seaweedfs)', str(self.root / "var" / "lib") + "/"),
            (re.escape(POOLD), f"{sys.executable} -m daemon.main"),
            (r"/opt/seaweedfs/bin/weed", weed_binary()),
            (r"10\.0\.0\.(10|21)\b", "127.0.0.1"),
        ):
            text = re.sub(old, new.replace("\\", r"\\"), text)
        for old_port, new_port in self.ports.items():
            text = re.sub(rf"(?<=[:= ]){old_port}\b", str(new_port), text)
        # Nothing it runs may touch this machine's own /etc or /var (a sed expression only edits text).
        rest = re.sub(r"s\|[^|]*\|[^|]*\||" + re.escape(str(self.root)) + r"\S*", "", text)
        outside = re.findall(r"(?<![\w.-])/(?:etc|var)/\S*", rest)
        assert not outside, f"the test would touch this machine's {outside}: make them local"
        for n, pattern in enumerate(patterns):
            text = text.replace(f"s|\0{n}\0|", f"s|{pattern}|", 1)
        return text

    def run(self, block: str) -> str:
        """Run a shell block's commands (pip left out) here; its standard output."""
        script = "\n".join(self.local(c) for c in commands(block))
        done = subprocess.run(
            ["bash", "-euc", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, f"{script}\n{done.stderr}"
        return done.stdout

    def unit(self, path: Path) -> tuple[list[str], dict[str, str]]:
        """The argv and environment a unit's ExecStart=, Environment= and StateDirectory= give poold."""
        lines = path.read_text().splitlines()
        [start] = [ln.removeprefix("ExecStart=") for ln in lines if ln.startswith("ExecStart=")]
        env = dict(
            ln.removeprefix("Environment=").split("=", 1) for ln in lines if ln.startswith("Environment=")
        )
        [state] = [ln.removeprefix("StateDirectory=") for ln in lines if ln.startswith("StateDirectory=")]
        env["STATE_DIRECTORY"] = str(self.root / "var" / "lib" / state)
        return self.local(start).split(), env


def verify_unit(text: str, copy: Path) -> None:
    """`systemd-analyze verify` prints nothing for the unit (as the guide says to run it), with
    ExecStart naming this venv's poold, which it insists exists (test_systemd_units.py)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        return  # test_systemd_units.py says it is skipped there
    copy.write_text(text.replace(POOLD, str(Path(sys.executable).parent / "poold")))
    argv = [analyze, "verify", str(copy)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


@contextmanager
def started(
    argv: list[str], env: dict[str, str], log: Path, ready: str, grace: float = 30
) -> Iterator[subprocess.Popen[bytes]]:
    """A process of the guide's, until `ready` shows in its log (bounded); stopped at the end
    (SIGTERM, SIGKILL after `grace` seconds)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, env={**os.environ, **env}, cwd=ROOT, stdout=out, stderr=out, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 60
        while ready not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.05)
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def s3_answers(endpoint: str) -> str:
    """`ready` for a weed started without a log line to wait for: polled until its S3 API answers."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(endpoint, timeout=2)
        except urllib.error.HTTPError:
            return ""  # 403 without a signature: the S3 API is up
        except OSError:
            time.sleep(0.1)
            continue
        return ""
    raise AssertionError(f"the guide's weed did not serve S3 on {endpoint} in 60 s")


async def test_the_guide_sets_up_a_pool_whose_two_workers_on_one_machine_take_jobs(
    tmp_path: Path, redis_server: EmbeddedRedis, queue: JobQueue
) -> None:
    """issue 47 item 11: following OPERATIONS.md's blocks gives a store with its bucket (made by
    `poold --make-bucket`, not MinIO's `mc`), a server that starts on it, and two workers on one
    machine from the guide's recipe, each with its own data directory and metrics port, both
    taking jobs at once and running them as uids of their own ranges (61000-61063, 61064-61127)."""
    blocks = guide_blocks()
    assert set(blocks) >= {"s3", "server-config", "worker-config", "bucket", "second-worker"}
    weed = weed_ports(5)
    ports = {"6379": redis_server.port, "7420": 0, "9420": 0, "9421": free_port(), "9422": free_port()}
    ports |= {flag.split("=")[1]: port for flag, port in zip(WEED_PORTS, weed, strict=True)}
    # The jobs' uids pass through every directory above their own (the worker checks): not pytest's.
    machines = Path(tempfile.mkdtemp(prefix="gpupool-guide-"))
    machines.chmod(0o711)
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, machines, True)
        pool_1, gpu_1 = Machine(machines / "pool-1", ports), Machine(machines / "gpu-1", ports)
        for flag in WEED_PORTS:  # the ports the guide names are the ones weed is told to use
            assert flag in blocks["s3"]

        # pool-1, §3: the key pair, and weed (started in the background, as its unit would).
        *setup, serve = commands(blocks["s3"])
        pool_1.run("\n".join(setup))
        secrets = pool_1.root / "etc" / "gpupool"
        (secrets / "redis-password").write_text(redis_server.password)
        (secrets / "tokens.toml").write_text('alice = "a-long-random-token-for-the-test"\n')
        (secrets / "tokens.toml").chmod(0o600)
        weed_log = tmp_path / "weed.log"
        # weed's own stop is not under test (it takes seconds): 0.5 s, then SIGKILL.
        stack.enter_context(started(["bash", "-c", pool_1.local(serve)], {}, weed_log, "", grace=0.5))
        s3_answers(f"http://127.0.0.1:{weed[0]}")

        # §5: pool-1's configuration, then the bucket.
        (secrets / "pool.toml").write_text(pool_1.local(blocks["server-config"]))
        made = pool_1.run(blocks["bucket"])
        assert made == f"poold: bucket 'gpupool' at http://127.0.0.1:{weed[0]} is ready\n"
        argv, env = pool_1.unit(ROOT / "systemd" / "pool-server.service")
        env["XDG_CONFIG_HOME"] = str(pool_1.root / "xdg")
        stack.enter_context(started(argv, env, tmp_path / "server.log", "server ready on "))

        # gpu-1, §5 and §6: its configuration (pool-1's Redis and S3 lines), the second worker's.
        server_lines = blocks["server-config"].splitlines()
        last = next(i for i, ln in enumerate(server_lines) if ln.startswith("main_server_minio_secret"))
        (gpu_1.root / "etc" / "gpupool").mkdir()
        for name in ("redis-password", "minio-secret"):
            shutil.copy2(secrets / name, gpu_1.root / "etc" / "gpupool" / name)
        config = "\n".join(server_lines[: last + 1]) + "\n" + blocks["worker-config"] + "\n"
        (gpu_1.root / "etc" / "gpupool" / "pool.toml").write_text(gpu_1.local(config))
        gpu_1.run(blocks["second-worker"])
        unit_b = (gpu_1.root / "units" / "pool-worker-b.service").read_text()
        for changed in (
            "pool-b.toml",
            "=61064-61127",
            "StateDirectory=gpupool-b\n",
            "ReadWritePaths=/var/lib/gpupool-b\n",
        ):
            assert changed in unit_b  # each of the guide's `sed -e` matched the shipped unit
        verify_unit(unit_b, machines / "pool-worker-b.service")
        units = {
            "a": ROOT / "systemd" / "pool-worker.service",
            "b": gpu_1.root / "units" / "pool-worker-b.service",
        }
        ranges = {}
        for name, path in units.items():
            argv, env = gpu_1.unit(path)
            env["XDG_CONFIG_HOME"] = str(gpu_1.root / f"xdg-{name}")
            low, high = env["GPUPOOL_JOB_UID_RANGE"].split("-")
            ranges[name] = range(int(low), int(high) + 1)
            stack.enter_context(started(argv, env, tmp_path / f"worker-{name}.log", ""))
        assert (ranges["a"], ranges["b"]) == (range(61000, 61064), range(61064, 61128))

        # Four jobs, two slots a worker: all four run at once only if both workers took two.
        await wait_until(lambda: _workers(queue, 2), 30, "both workers to be listed")
        for data_dir in ("gpupool", "gpupool-b"):  # each its own, from its unit and configuration
            assert (gpu_1.root / "var" / "lib" / data_dir / "worker").is_dir()
        release = machines / "release"  # the jobs end once it exists: after they were seen together
        job = JobSpec(argv=("sh", "-c", f"while [ ! -e {release} ]; do sleep 0.02; done"))
        ids = [(await queue.enqueue(job))[0] for _ in range(4)]
        await wait_until(lambda: _all_running(queue, ids), 30, "all four jobs to run at once")
        infos = [await queue.get(i) for i in ids]
        await wait_until(lambda: _sleeping(4), 30, "the four jobs' shells to exec")
        uids = await _job_uids()
        assert len({i.worker for i in infos}) == 2
        assert [sum(u in ranges[w] for u in uids) for w in "ab"] == [2, 2], uids
        release.touch()
        await wait_until(lambda: _all_done(queue, ids), 30, "the jobs to end")


async def _job_uids() -> list[int]:
    """The uids of the jobs' shells (each as its slot's uid: none of this machine's users)."""
    shells = psutil.process_iter(["name", "uids"])  # a process gone meanwhile is left out
    found = (p.info["uids"].real for p in shells if p.info["name"] == "sh" and p.info["uids"])
    return sorted(u for u in found if u >= 61000)


async def _sleeping(n: int) -> bool:
    return len(await _job_uids()) >= n


async def _workers(queue: JobQueue, n: int) -> bool:
    return len(await list_workers(queue.redis)) >= n


async def _all_running(queue: JobQueue, ids: list[str]) -> bool:
    return all(info.state is JobState.RUNNING for info in [await queue.get(i) for i in ids])


async def _all_done(queue: JobQueue, ids: list[str]) -> bool:
    return all(info.state is JobState.SUCCEEDED for info in [await queue.get(i) for i in ids])
