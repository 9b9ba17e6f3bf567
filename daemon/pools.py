"""The pools a user reaches by name: `~/.config/gpupool/pools.toml` (under $XDG_CONFIG_HOME).

    default = "lab"                     # the pool when none is named (else "local", if there is one)

    [pools.local]                       # kept current by a single-machine pool (make run) as it starts
    server = "127.0.0.1:7420"
    token_file = "~/.config/gpupool/token"

    [pools.lab]
    server = "gpu-head.lab.example:7420"
    token_file = "~/.config/gpupool/lab.token"
    user = "alice"                      # her name on that pool, when not her login name here
    tls_pin = "SHA256:3f1c..."          # the fingerprint its poold logged at start (else pinned on first use)
    # tls_ca = "/etc/ssl/lab-ca.pem"    # or: the CA that signed its certificate
    # tls = "on"                        # auto (TLS beyond loopback), on, off

Which pool a command talks to: the first of `--server HOST:PORT`, `--pool NAME`, GPUPOOL_SERVER,
GPUPOOL_POOL, the file's `default`, its `local` pool, 127.0.0.1:7420 (`choose`). Reading costs
poolctl a TOML parser only when the file exists; the server edits the file with tomlkit, which
keeps the user's comments and order, and never imports it anywhere poolctl does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from daemon.address import SERVER_PORT
from daemon.errors import GpupoolError
from daemon.tokens import client_dir, write_private
from protocol import ErrorCode
from protocol.record import Record

LOCAL = "local"  # the name a single-machine pool registers itself under
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
        return find(LOCAL, env, "")
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


def register_local(
    server: str, token_file: Path, tls_pin: str | None = None, env: Mapping[str, str] | None = None
) -> None:
    """A single-machine pool's own entry, [pools.local], kept current (with the fingerprint of
    the certificate it made itself, if it speaks TLS); the rest of the file stays as its user
    wrote it. Raises PoolsError if the file cannot be read or written."""
    import tomlkit  # noqa: PLC0415 - the server's side only
    from tomlkit.exceptions import TOMLKitError  # noqa: PLC0415

    path = pools_file(env)
    try:
        document = tomlkit.parse(path.read_text()) if path.exists() else tomlkit.document()
        pools = document.setdefault("pools", tomlkit.table(is_super_table=True))
        entry = {"server": server, "token_file": str(token_file)}
        if tls_pin:
            entry["tls_pin"] = tls_pin
        if pools.get(LOCAL) == entry:
            return
        pools[LOCAL] = entry
        write_private(path, tomlkit.dumps(document))
    except (OSError, TOMLKitError, AttributeError) as exc:  # AttributeError: `pools` not a table
        raise PoolsError(f"could not register this pool as {LOCAL!r} in {path}: {exc}") from None
