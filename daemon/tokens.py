"""Who may talk to the server, and how poolctl finds its server and token.

Server side: a tokens file of ``user = "token"`` lines (TOML), readable by its owner only (0600); a
pool admin, who may act on every user's jobs, is written ``user = { token = "token", admin = true }``,
and a user's priority ceiling (the highest ``--priority`` their jobs may ask for)
``user = { token = "token", max_priority = 10 }``, and their weight in fair-share queues (their
recent use is divided by it: 2 starts twice as much) ``user = { token = "token", fairshare_weight = 2 }``.
Client side: ``GPUPOOL_TOKEN``, else the pool's own ``token_file`` (pools.toml: daemon/pools.py,
which also says where the server is), else the file ``gpupool/token`` under ``$XDG_CONFIG_HOME``
(default ``~/.config``); the user is ``GPUPOOL_USER``, else the pool's ``user``, else the login name.
"""

from __future__ import annotations

import getpass
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from daemon.errors import GpupoolError
from protocol.record import Record

TOKEN_BYTES = 32
MAX_WEIGHT = 1000  # the largest fairshare_weight


class TokenError(GpupoolError):
    """A tokens file cannot be read, or does not hold lines of user = "token"."""


def client_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME") or Path.home()) / ".config")
    return Path(base) / "gpupool"


def local_user(env: Mapping[str, str] | None = None, pool_user: str | None = None) -> str:
    env = os.environ if env is None else env
    return env.get("GPUPOOL_USER") or pool_user or getpass.getuser()


def write_private(path: Path, text: str) -> None:
    """Replace `path` with `text`, readable by its owner alone, never half-written."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # two writers never share one
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


def client_token(env: Mapping[str, str] | None = None, token_file: str | None = None) -> str | None:
    """GPUPOOL_TOKEN, else the pool's `token_file` (pools.toml), else the default file; None when
    the default file does not exist (an open pool needs none)."""
    env = os.environ if env is None else env
    if token := env.get("GPUPOOL_TOKEN"):
        return token.strip()
    path = Path(token_file) if token_file else client_dir(env) / "token"
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if token_file:
            raise TokenError(f"{path}, this pool's token_file in pools.toml, does not exist") from None
        return None
    refuse_open(path, mode)
    return path.read_text().strip() or None


def refuse_open(path: Path, mode: int, what: str = "") -> None:
    """A file holding a secret (a token, a tokens file, a worker's config) must be closed to its
    group and to others, as ssh requires of a private key: refused with the chmod that mends it.
    `what` says what the file is, after its name."""
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TokenError(
            f"{path}{what} is readable by others (mode {stat.S_IMODE(mode):o}): chmod 600 {path}"
        )


def ensure_local_token(data_dir: Path, env: Mapping[str, str] | None = None) -> Path:
    """Single-machine pools: make sure the local user has a token that the server accepts and that
    poolctl finds (the client file; kept if there is one). Returns the server's tokens file."""
    token = client_token(env)
    if token is None:
        import secrets  # noqa: PLC0415 - the server's side: poolctl shares this module, never needs it

        token = secrets.token_urlsafe(TOKEN_BYTES)
        write_private(client_dir(env) / "token", token + "\n")
    path = data_dir / "tokens.toml"
    tokens = dict(read_tokens(path)) if path.exists() else {}
    user = local_user(env)
    if tokens.get(user) != token.encode():
        tokens[user] = token.encode()
        write_private(path, "".join(f'"{u}" = "{t.decode()}"\n' for u, t in sorted(tokens.items())))
    return path


class Users(Record):
    """Who the server accepts: each user's token, which of them are the pool's admins, and the
    priority ceilings the file gives."""

    tokens: dict[str, bytes]
    admins: frozenset[str] = frozenset()
    max_priority: tuple[tuple[str, int], ...] = ()  # (user, ceiling) of those the file gives one
    weights: tuple[tuple[str, float], ...] = ()  # (user, fair-share weight) of those given one


def read_tokens(path: Path) -> dict[str, bytes]:
    """The server's user -> token map (read_users, less who is an admin)."""
    return read_users(path).tokens


def read_users(path: Path) -> Users:
    """The tokens file. Refuses a file others can read: tokens are passwords."""
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as exc:
        raise TokenError(f"cannot read the tokens file {path}: {exc.strerror}") from None
    refuse_open(path, mode, ", the tokens file,")
    import tomllib  # noqa: PLC0415 - the server's side, as above

    from daemon.spec_checks import PRIORITY_MAX  # noqa: PLC0415 - as tomllib: poolctl reads no tokens file

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TokenError(
            f'tokens file {path} is not valid TOML ({exc}); expected lines of user = "token"'
        ) from None
    tokens: dict[str, bytes] = {}
    admins = set()
    ceilings: dict[str, int] = {}
    weights: dict[str, float] = {}
    for user, entry in data.items():
        token, admin = (
            (entry.get("token"), entry.get("admin", False)) if isinstance(entry, dict) else (entry, False)
        )
        ceiling = entry.get("max_priority", 0) if isinstance(entry, dict) else 0
        weight = entry.get("fairshare_weight", 1) if isinstance(entry, dict) else 1
        if isinstance(entry, dict) and (
            set(entry) - {"token", "admin", "max_priority", "fairshare_weight"}
            or not isinstance(admin, bool)
            or type(ceiling) is not int
            or not 0 <= ceiling <= PRIORITY_MAX
            or type(weight) not in (int, float)
            or not 0 < weight <= MAX_WEIGHT
        ):
            raise TokenError(
                f'tokens file {path}: {user!r} must be "token" or {{ token = "token", admin = true, '
                f"max_priority = 0..{PRIORITY_MAX}, fairshare_weight = a number above 0 up to "
                f"{MAX_WEIGHT} }} (each but the token optional), not a table of {sorted(entry)}"
            )
        if isinstance(entry, dict) and "max_priority" in entry:
            ceilings[user] = ceiling
        if isinstance(entry, dict) and "fairshare_weight" in entry:
            weights[user] = float(weight)
        if not isinstance(token, str) or len(token) < 16:
            raise TokenError(
                f"tokens file {path}: the token of {user!r} must be a string of 16 or more characters"
            )
        tokens[user] = token.encode()
        if admin:
            admins.add(user)
    return Users(tokens, frozenset(admins), tuple(sorted(ceilings.items())), tuple(sorted(weights.items())))
