"""How a client reaches its pool: where, as whom, and how it trusts the server (`reach`), for
poolctl (cli.py) and the Python API (gpupool/pool.py) alike, so that both talk to the same pool
with the same user and token."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from daemon import tokens
from daemon.client import session
from daemon.client.session import ClientError
from daemon.ctl import one_shot
from daemon.ctl.parsing import UsageError
from daemon.pools import choose
from protocol import Reply, Request, StreamItem
from protocol.record import Record

if TYPE_CHECKING:
    from daemon.client.pool_client import PoolClient

R = TypeVar("R", bound=Reply)


class Link(Record):
    """How a client reaches its pool: where, as whom, and how it trusts the server."""

    server: str
    user: str
    token: str | None
    tls_ca: str | None
    tls: str  # auto: TLS beyond loopback; on; off (GPUPOOL_TLS means the same as poold's `tls`)
    tls_pin: str | None
    name: str | None = None  # the pool's, in pools.toml, when it was chosen by one

    def call(
        self, request: Request, reply_type: type[R], on_item: Callable[[StreamItem], None] | None = None
    ) -> R:
        """One request and its reply, over a blocking socket (one_shot.py); streamed items to `on_item`."""
        return one_shot.call(
            self.server, self.user, self.token, request, reply_type,
            tls_ca=self.tls_ca, tls=self.tls, tls_pin=self.tls_pin, on_item=on_item,
        )  # fmt: skip

    def client(self) -> PoolClient:
        """A connection for an event loop: streams and transfers."""
        from daemon.client.pool_client import PoolClient

        return PoolClient(
            self.server, self.user, self.token, tls_ca=self.tls_ca, tls=self.tls, tls_pin=self.tls_pin
        )


def reach(server: str | None, pool: str | None, tls_ca: str | None, who: str = "poolctl") -> Link:
    """The pool to talk to (daemon/pools.py says which of `server` (--server), `pool` (--pool),
    GPUPOOL_SERVER, GPUPOOL_POOL, pools.toml), its addresses checked (one server, or several of
    the pool, comma-separated), and its user and token. `who` starts what it says on stderr."""
    chosen = choose(server, pool)
    if chosen.note is not None:  # another pool could be meant: say which this is
        print(f"{who}: {chosen.note}", file=sys.stderr)
    try:
        session.addresses(chosen.server)
    except ClientError as exc:
        raise UsageError(f"{exc} (pool {chosen.name})" if chosen.name else str(exc)) from None
    return Link(
        server=chosen.server,
        name=chosen.name,
        user=tokens.local_user(pool_user=chosen.user),
        token=tokens.client_token(token_file=chosen.token_file),
        tls_ca=tls_ca or os.environ.get("GPUPOOL_TLS_CA") or chosen.tls_ca,
        tls=os.environ.get("GPUPOOL_TLS") or chosen.tls or "auto",
        tls_pin=chosen.tls_pin,
    )
