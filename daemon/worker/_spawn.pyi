# The C module's signatures (_spawn.c says what each does).
from collections.abc import Sequence

def spawn(
    paths: Sequence[bytes],
    argv: Sequence[bytes],
    envp: Sequence[bytes],
    cwd: bytes,
    stdin_fd: int,
    out_fd: int,
    uid: int,
    gid: int,
    cgroup_fd: int,
    born_in: bool,
    nice: int,
    hidden: Sequence[bytes],
    own_ipc: bool,
    own_net: bool,
    err_fd: int = -1,
    net_fd: int = -1,
    ipc_fd: int = -1,
    ctty: bool = False,
    joins: tuple[int, ...] = (),
    /,
) -> tuple[int, int]: ...
def sweep(uid: int, gid: int, /) -> tuple[int, int]: ...
def reap(pid: int, pidfd: int, block: bool = False, /) -> tuple[int, int, str | None] | None: ...
def sysv_objects() -> bool: ...
