"""A real one-node Slurm cluster on loopback, for the pilot tests: Debian's `slurm-wlm` and `munge`.

munged runs with its own key and socket, slurmctld and slurmd in the foreground (-D) as this
process's children, with a minimal slurm.conf whose state, spool, pid and log files all live in
one temporary directory, and ports chosen free. No cgroups (proctrack/linuxproc, task/none), no
accounting (sacct has nothing to say: a finished job is read with `scontrol show job`, which
keeps it for MinJobAge), no GPUs (a pilot asks for none). Everything runs as root: slurmd starts
each job as its user, which only root can do. Every wait is bounded; `stop()` cancels what still
runs, then stops the daemons (SIGTERM, then SIGKILL).

munged checks that every directory above its socket lets everyone through (execute for all), so
the cluster's directory is made under the system's /tmp, not under pytest's private one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from daemon.queue.embedded_redis import free_port
from tests.support.processes import terminate_all

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo", "scancel")
START_TIMEOUT = 30.0  # until sinfo shows the node idle
STOP_TIMEOUT = 30.0  # for the jobs still running to end once cancelled


def missing() -> str | None:
    """Why a cluster cannot be started here (for pytest.skip), or None."""
    if absent := [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]:
        return f"Slurm is not installed here ({', '.join(absent)} missing: apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "a test Slurm cluster runs slurmd as root, to start jobs as their users; this is not root"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    """`start()`, then submit with `env` (SLURM_CONF) in the environment; `stop()` at the end."""

    def __init__(self, extra_config: str = "") -> None:
        """`extra_config`: lines added to slurm.conf (a bench's scheduler parameters)."""
        self.extra_config = extra_config
        self.dir = Path(tempfile.mkdtemp(prefix="gpupool-slurm-"))
        self.dir.chmod(0o755)
        self.conf = self.dir / "slurm.conf"
        self.socket = self.dir / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self) -> None:
        """Start munged, slurmctld and slurmd; return once the node is idle (else AssertionError)."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        private = self.dir / "private"
        private.mkdir(mode=0o700)
        key = private / "munge.key"
        key.write_bytes(secrets.token_bytes(128))
        key.chmod(0o400)
        self._spawn(
            "munged",
            "-F",
            f"--socket={self.socket}",
            f"--key-file={key}",
            f"--pid-file={self.dir / 'munged.pid'}",
            f"--seed-file={private / 'munged.seed'}",
            f"--log-file={self.dir / 'munged.log'}",
        )
        self._wait(self.socket.exists, "munged's socket")
        for sub in ("state", "spool"):
            (self.dir / sub).mkdir()
        self.conf.write_text(self._config(free_port(), free_port()))
        self._spawn("slurmctld", "-D", "-f", str(self.conf))
        self._spawn("slurmd", "-D", "-N", "localhost", "-f", str(self.conf))
        self._wait(lambda: self.run("sinfo", "-h", "-o", "%T").strip() == "idle", "the node to be idle")

    def _config(self, ctld_port: int, slurmd_port: int) -> str:
        d = self.dir
        return f"""\
ClusterName=gpupooltest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.socket}
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
StateSaveLocation={d / "state"}
SlurmdSpoolDir={d / "spool"}
SlurmctldPidFile={d / "slurmctld.pid"}
SlurmdPidFile={d / "slurmd.pid"}
SlurmctldLogFile={d / "slurmctld.log"}
SlurmdLogFile={d / "slurmd.log"}
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
{self.extra_config}"""

    def _spawn(self, name: str, *args: str) -> None:
        with open(self.dir / f"{name}.out", "ab") as out:
            proc = subprocess.Popen(
                [_binary(name), *args], stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.dir
            )
        self._procs.append((name, proc))

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not ready():
            for name, proc in self._procs:
                if proc.poll() is not None:
                    log = (self.dir / f"{name}.out").read_text(errors="replace")[-2000:]
                    raise AssertionError(f"{name} exited ({proc.returncode}) before {what}:\n{log}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; see {self.dir}")
            time.sleep(0.1)

    def run(self, *argv: str) -> str:
        """A Slurm command's output ("" when it fails), within a bound."""
        try:
            done = subprocess.run(
                [_binary(argv[0]), *argv[1:]],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return ""
        return done.stdout if done.returncode == 0 else ""

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, StartTime, EndTime, ...)."""
        fields = {}
        for part in self.run("scontrol", "-o", "show", "job", job_id).split():
            name, sep, value = part.partition("=")
            if sep:
                fields[name] = value
        return fields

    def queued(self) -> list[str]:
        """The ids of the jobs not yet ended."""
        return self.run("squeue", "-h", "-o", "%i").split()

    def stop(self) -> None:
        """Cancel every job and wait (bounded) for them to end, then stop the daemons."""
        up = any(name == "slurmctld" and p.poll() is None for name, p in self._procs)
        if up and (jobs := self.queued()):
            self.run("scancel", *jobs)
            deadline = time.monotonic() + STOP_TIMEOUT
            while self.queued() and time.monotonic() < deadline:
                time.sleep(0.2)
        terminate_all([proc for _, proc in reversed(self._procs)], 10)
        self._procs.clear()
        with contextlib.suppress(OSError):
            shutil.rmtree(self.dir)
