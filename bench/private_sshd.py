"""The private sshd that bench/interactive.py's ssh rows go through.

Debian's openssh-server, `/usr/sbin/sshd` (the Makefile installs it for the tests where it runs as
root): this process's child, `sshd -D -e -f CONFIG` with a config of its own in a temporary
directory (listening on 127.0.0.1 at a free port, its own host key, only its own key authorized
for this user, no PAM, no password, StrictModes off since the directory is under /tmp, its PidFile
there: written once it listens), stopped at the end after the ssh clients. As root it needs
/run/sshd (its privilege separation directory, which the systemd unit makes): made here when
missing. Where sshd is not installed, or does not start, `private_sshd` yields why. ssh uses
OpenSSH's defaults (its cipher and MAC), with no config file of the user's.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.common import free_port

SSHD = "/usr/sbin/sshd"
START_LIMIT = 30.0  # seconds ssh-keygen may take, and sshd to start listening


@dataclass
class Ssh:
    """How to reach the private sshd: `args` an ssh command line up to (not including) the
    remote command."""

    pid: int  # sshd's
    port: int
    args: list[str]


def sshd_config(tmp: Path, port: int, user: str) -> str:
    return (
        f"ListenAddress 127.0.0.1:{port}\n"
        f"HostKey {tmp / 'host_key'}\n"
        f"PidFile {tmp / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {tmp / 'authorized_keys'}\n"
        f"AllowUsers {user}\n"
        "AuthenticationMethods publickey\n"
        "PubkeyAuthentication yes\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\n"
        "UsePAM no\n"
        # Checks every directory above the keys for group or world write, /tmp (1777) among them.
        "StrictModes no\n"
        "AllowTcpForwarding local\n"
        "X11Forwarding no\n"
        "UseDNS no\n"
        "PrintMotd no\n"
    )


@contextlib.contextmanager
def private_sshd(tmp: Path) -> Iterator[Ssh | str]:
    """A private sshd (see the module's docstring), ready; or why there is none."""
    if not os.access(SSHD, os.X_OK):
        yield "sshd not installed (Debian's openssh-server)"
        return
    if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        yield "ssh not installed (Debian's openssh-client)"
        return
    for name in ("host_key", "user_key"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / name)],
            check=True,
            timeout=START_LIMIT,
        )
    shutil.copy(tmp / "user_key.pub", tmp / "authorized_keys")
    port, user = free_port(), pwd.getpwuid(os.geteuid()).pw_name
    (tmp / "sshd_config").write_text(sshd_config(tmp, port, user))
    host_key = " ".join((tmp / "host_key.pub").read_text().split()[:2])
    (tmp / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_key}\n")
    if os.geteuid() == 0 and not os.path.isdir("/run/sshd"):
        os.makedirs("/run/sshd", mode=0o755)  # its privilege separation directory, as root
    with open(tmp / "sshd.log", "wb") as log:
        proc = subprocess.Popen(
            [SSHD, "-D", "-e", "-f", str(tmp / "sshd_config")], stdout=log, stderr=log, start_new_session=True
        )
    try:
        deadline = time.monotonic() + START_LIMIT
        while not (tmp / "sshd.pid").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # its PidFile is written once it listens
        if not (tmp / "sshd.pid").exists():
            said = (tmp / "sshd.log").read_text(errors="replace").strip().splitlines()
            yield f"sshd did not start: {said[-1] if said else f'exit {proc.poll()}'}"
            return
        yield Ssh(
            proc.pid,
            port,
            [
                "ssh", "-F", "/dev/null", "-i", str(tmp / "user_key"), "-o", "IdentitiesOnly=yes",
                "-o", f"UserKnownHostsFile={tmp / 'known_hosts'}", "-o", "GlobalKnownHostsFile=/dev/null",
                "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR",
                "-p", str(port), f"{user}@127.0.0.1",
            ],
        )  # fmt: skip
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
