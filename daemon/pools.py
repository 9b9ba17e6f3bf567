"""The pools a user reaches by name: `~/.config/gpupool/pools.toml` (under $XDG_CONFIG_HOME).

    default = "lab"                     # the pool when none is named (else "local", if there is one)

    [pools.local]                       # kept current by a single-machine pool (make run) as it starts
    server = "unix:/home/alice/gpupool/data/pool.sock"
    token_file = "~/.config/gpupool/token"

    [pools.local-2]                     # a second one, started while the first still ran
    server = "127.0.0.1:7430"
    token_file = "~/.config/gpupool/token"

    [pools.lab]
    server = "gpu-head.lab.example:7420"
    token_file = "~/.config/gpupool/lab.token"
    user = "alice"                      # her name on that pool, when not her login name here
    tls_pin = "SHA256:3f1c..."          # the fingerprint its poold logged at start (else pinned on first use)
    # tls_ca = "/etc/ssl/lab-ca.pem"    # or: the CA that signed its certificate
    # tls = "on"                        # auto (TLS beyond loopback), on, off

Each single-machine pool on this machine has a name of its own (`register_local`): the one it had,
found by its address (a pool keeps its name across restarts, and its user may rename its entry),
else the first of local, local-2, local-3... that is free or whose pool runs no more (nothing
answers at its address: a stale entry, replaced and said so). A live pool's entry is never taken.

Which pool a command talks to: the first of `--server HOST:PORT`, `--pool NAME`, GPUPOOL_SERVER,
GPUPOOL_POOL, the file's `default`, its `local` pool, 127.0.0.1:7420 (`choose`). When `local` is
chosen for want of any other choice and another pool on this machine runs too, poolctl says which
it talks to and how to choose (`Pool.note`); when a pool on this machine is chosen and nothing
answers at its address, it says the pool is registered but not running (`not_running`). Reading costs
poolctl a TOML parser only when the file exists; the server edits the file with tomlkit, which
keeps the user's comments and order, and never imports it anywhere poolctl does.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

from daemon.address import SERVER_PORT, is_loopback, parse_host_port, unix_path
from daemon.errors import GpupoolError
from daemon.tokens import client_dir, write_private
from protocol import ErrorCode
from protocol.record import Record, fields

LOCAL = "local"  # the name the first single-machine pool registers under; the next, local-2...
MAX_LOCAL = 100  # single-machine pools on one machine, at most, that each get a name
PROBE_SECONDS = 1.0  # how long an address may take to accept before its pool counts as running
KEYS = ("server", "token_file", "user", "tls_ca", "tls_pin", "tls")  # a pool's, all strings


class PoolsError(GpupoolError):
    """pools.toml cannot be read, or does not name the pool asked for."""

    code = ErrorCode.INVALID_ARGUMENT


class Pool(Record):
    """Where poolctl connects and how: a pools.toml entry, or just an address (`name` None)."""

    server: str
    name: str | None = None
    token_file: str | None = None  # `~` expanded
    user: str | None = None
    tls_ca: str | None = None
    tls_pin: str | None = None
    tls: str | None = None
    note: str | None = None  # what poolctl says first: which pool, when another could be meant


def pools_file(env: Mapping[str, str] | None = None) -> Path:
    return client_dir(env) / "pools.toml"


def choose(server: str | None, pool: str | None, env: Mapping[str, str] | None = None) -> Pool:
    """The pool a command talks to, given its --server and --pool (see the module's docstring)."""
    env = os.environ if env is None else env
    if server and pool:
        raise PoolsError(f"--server {server} and --pool {pool} each name a pool: give one of them")
    if server:
        return Pool(server)
    if pool:
        return find(pool, env, "--pool")
    if server := env.get("GPUPOOL_SERVER", "").strip():
        return Pool(server)
    if pool := env.get("GPUPOOL_POOL", "").strip():
        return find(pool, env, "GPUPOOL_POOL")
    data = read(env)
    if "default" in data:
        return find(data["default"], env, f"{pools_file(env)}'s default")
    if LOCAL in data.get("pools", {}):
        local = find(LOCAL, env, "")
        if not (others := running_locals(data, but=LOCAL)):
            return local
        note = (
            f"talking to pool {LOCAL!r} ({local.server}); {', '.join(others)} in {pools_file(env)} "
            f"{'runs' if len(others) == 1 else 'run'} too: choose with --pool NAME, or "
            'default = "NAME" in that file'
        )
        return Pool(**{**{n: getattr(local, n) for n in fields(Pool)}, "note": note})
    return Pool(f"127.0.0.1:{SERVER_PORT}")


def find(name: str, env: Mapping[str, str], named_by: str) -> Pool:
    """The pool called `name` in pools.toml (`named_by` says who asked for it, for the error)."""
    path = pools_file(env)
    pools = read(env).get("pools", {})
    if not isinstance(pools, dict) or name not in pools:
        known = ", ".join(sorted(pools)) if isinstance(pools, dict) and pools else "none yet"
        where = f" ({named_by})" if named_by else ""
        raise PoolsError(
            f"no pool {name!r}{where} in {path}; the pools there: {known}. "
            f'Add one as [pools.{name}] with server = "HOST:PORT"'
        )
    entry = pools[name]
    if not isinstance(entry, dict):
        raise PoolsError(f'{path}: pools.{name} must be a table, [pools.{name}] with server = "HOST:PORT"')
    if unknown := sorted(set(entry) - set(KEYS)):
        raise PoolsError(f"{path}: [pools.{name}] has no key {unknown[0]!r}; its keys are {', '.join(KEYS)}")
    if bad := [k for k, v in entry.items() if not isinstance(v, str) or not v.strip()]:
        raise PoolsError(f"{path}: [pools.{name}] {bad[0]} must be a non-empty string")
    if "server" not in entry:
        raise PoolsError(f'{path}: [pools.{name}] needs server = "HOST:PORT"')
    values: dict[str, Any] = {k: entry[k].strip() for k in KEYS if k in entry}
    if "token_file" in values:
        values["token_file"] = os.path.expanduser(values["token_file"])
    return Pool(name=name, **values)


def read(env: Mapping[str, str]) -> dict[str, Any]:
    """The parsed file; empty when there is none."""
    path = pools_file(env)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise PoolsError(f"cannot read {path}: {exc.strerror}") from None
    import tomllib  # noqa: PLC0415 - only a user with a pools file pays for the parser

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PoolsError(f"{path} is not valid TOML: {exc}") from None
    if "default" in data and not isinstance(data["default"], str):
        raise PoolsError(f'{path}: default must be a pool\'s name, e.g. default = "{LOCAL}"')
    return data


def local_names() -> Iterator[str]:
    """The names single-machine pools register under, in the order they are given out."""
    yield LOCAL
    for n in range(2, MAX_LOCAL + 1):
        yield f"{LOCAL}-{n}"


def on_this_machine(server: str) -> bool:
    """Whether `server` is one address on this machine (a Unix socket, or loopback): a pool whose
    address answers nothing there is not running, rather than beyond a network."""
    if unix_path(server) is not None:
        return True
    try:
        return is_loopback(parse_host_port(server)[0])
    except ValueError:
        return False


def answers(server: str) -> bool:
    """Whether something accepts a connection at `server` (HOST:PORT or unix:PATH, one address):
    how the entry of a single-machine pool that runs no more is told from a live one. A pool
    killed leaves its socket's file or its port behind it, and either refuses a connection."""
    path = unix_path(server)
    try:
        if path is not None:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(PROBE_SECONDS)
                sock.connect(path)
        else:
            socket.create_connection(parse_host_port(server), PROBE_SECONDS).close()
    except TimeoutError:
        return True  # something holds the address, slow to accept: not a pool to replace
    except (OSError, ValueError):
        return False
    return True


def running_locals(data: Mapping[str, Any], but: str) -> list[str]:
    """The pools of the file `data` (read's) on this machine that answer, `but` aside."""
    pools = data.get("pools", {})
    if not isinstance(pools, dict):
        return []
    return [
        name
        for name, entry in sorted(pools.items())
        if name != but
        and isinstance(entry, dict)
        and isinstance(entry.get("server"), str)
        and on_this_machine(entry["server"])
        and answers(entry["server"])
    ]


def not_running(name: str, server: str, env: Mapping[str, str] | None = None) -> str | None:
    """When the pool `name` is on this machine and nothing answers at its `server`: the sentence
    that says so, and which pools here run instead; else None (it is elsewhere, or up)."""
    if not on_this_machine(server) or answers(server):
        return None
    env = os.environ if env is None else env
    path = pools_file(env)
    others = running_locals(read(env), but=name)
    instead = (
        f"or choose one that runs: {', '.join(f'--pool {name}' for name in others)}"
        if others
        else "or name another with --pool NAME or --server HOST:PORT"
    )
    return (
        f"pool {name!r} is registered in {path} but not running (nothing answers at "
        f"{server}). Start it again (`make run` in its directory), {instead}"
    )


def register_local(
    server: str, token_file: Path, tls_pin: str | None = None, env: Mapping[str, str] | None = None
) -> str:
    """A single-machine pool's own entry in pools.toml, kept current (with the fingerprint of the
    certificate it made itself, if it speaks TLS), under a name of its own (the module's docstring
    says which); the rest of the file stays as its user wrote it. Two pools starting at once take
    turns (a lock on the directory). Returns the sentence to log: the name, and the stale entry it
    replaced or the live pool that kept `local`. Raises PoolsError if the file cannot be read or
    written, or every name is held by a live pool."""
    import fcntl  # noqa: PLC0415 - the server's side only (poolctl may run where there is none)

    import tomlkit  # noqa: PLC0415 - the server's side only
    from tomlkit.exceptions import TOMLKitError  # noqa: PLC0415

    path = pools_file(env)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = os.open(path.parent, os.O_RDONLY)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            document = tomlkit.parse(path.read_text()) if path.exists() else tomlkit.document()
            pools = document.setdefault("pools", tomlkit.table(is_super_table=True))
            if not isinstance(pools, MutableMapping):
                raise PoolsError(
                    f"could not register this pool in {path}: its pools must be [pools.NAME] tables"
                )
            name, said = _name_for(server, pools, path)
            entry: dict[str, Any] = {"server": server, "token_file": str(token_file)}
            if isinstance(before := pools.get(name), Mapping) and before.get("server") == server:
                entry |= {k: v for k, v in before.items() if k not in (*entry, "tls_pin")}  # its user's
            if tls_pin:
                entry["tls_pin"] = tls_pin
            if pools.get(name) != entry:
                pools[name] = entry
                write_private(path, tomlkit.dumps(document))
            return said
        finally:
            os.close(lock)  # and with it the lock
    except (OSError, TOMLKitError) as exc:
        raise PoolsError(f"could not register this pool in {path}: {exc}") from None


def _name_for(server: str, pools: Mapping[str, Any], path: Path) -> tuple[str, str]:
    """The name the pool at `server` registers under in `pools` (the file's), and the sentence
    that says why."""

    def server_of(name: str) -> str | None:
        entry = pools.get(name)
        return entry.get("server") if isinstance(entry, Mapping) else None

    names = list(local_names())
    for name in [*names, *pools]:  # its own, from before, under the name it was given or renamed to
        if server_of(name) == server:
            return name, f"registered as pool {name!r} in {path}"
    live: list[str] = []
    for name in names:
        held = server_of(name)
        if name not in pools:
            break
        if held is None or not answers(held):
            how = f"was registered at {held}, which runs no more" if held else "had no server"
            return name, f"pool {name!r} in {path} {how}: registered this pool as {name!r} in its place"
        live.append(name)
    else:
        raise PoolsError(f"pools {LOCAL} to {names[-1]} all run: stop one")
    if not live:
        return name, f"registered as pool {name!r} in {path}"
    return name, (
        f"registered as pool {name!r} in {path}: {', '.join(live)} "
        f"{'is another pool' if len(live) == 1 else 'are other pools'}, still running; "
        f"poolctl --pool {name} reaches this one"
    )
