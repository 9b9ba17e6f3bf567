"""Failed authentications slow the next ones: per peer address and per user name, with back-off.

One object, no I/O (the caller says what time it is), used by the wire handshake (listener.py and
session.py) and the dashboard's sign-in (web/app.py) alike, so a guesser gains nothing by
switching between them. Each address and each user name may fail FREE times; after that every
further failure doubles its back-off, from FIRST seconds up to MOST, and a success from it (or for
that user) forgets them.

- A peer in back-off is refused before its token is looked at: the refusal is the same whether the
  token it would have sent is right or wrong, so it tells a guesser nothing new, and other peers
  are not affected (the real user, from their own machine, still gets in).
- A user name in back-off is slowed, not locked: attempts for it are answered one per back-off
  step (at most MOST_WAIT), however many arrive at once and from however many peers, each after
  waiting its turn (`wait`). The real user's attempt waits too, then gets its answer; only when the
  turns of MOST_WAIT seconds ahead are all taken is an attempt refused, to be tried again, so a
  flood of guesses slows the user's sign-in but never shuts them out for good.

Memory is bounded: the newest REMEMBERED peers and user names are kept (least recently failed
ones forgotten first). IPv6 peers count by their /64, the block one host is usually given.
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from dataclasses import dataclass

FREE = 5  # failures before the back-off begins
FIRST = 1.0  # seconds of the first back-off
MOST = 60.0  # seconds the back-off grows to at most
MOST_WAIT = 10.0  # seconds an attempt for a user in back-off may wait for its turn
REMEMBERED = 4096  # peers, and user names, kept at most


@dataclass(slots=True)
class Failures:
    """What is known of one peer or one user name: its failures in a row, and until when it waits
    (a peer: refused until then; a user: the next attempt's turn)."""

    count: int = 0
    until: float = 0.0


class Throttle:
    def __init__(
        self,
        *,
        free: int = FREE,
        first: float = FIRST,
        most: float = MOST,
        most_wait: float = MOST_WAIT,
        remembered: int = REMEMBERED,
    ) -> None:
        self.free, self.first, self.most, self.most_wait = free, first, most, most_wait
        self._remembered = remembered
        self._peers: OrderedDict[str, Failures] = OrderedDict()
        self._users: OrderedDict[str, Failures] = OrderedDict()

    def refused(self, peer: str, now: float) -> float:
        """Seconds until `peer` may try again; 0 when it may now."""
        failures = self._peers.get(_block(peer))
        return max(0.0, failures.until - now) if failures is not None else 0.0

    def wait(self, user: str, now: float) -> float | None:
        """Seconds an attempt for `user` waits for its answer (0: none), its turn taken; None when
        its turn is further off than `most_wait` (refused: try again later)."""
        failures = self._users.get(user)
        if failures is None or failures.count < self.free:
            return 0.0
        turn = max(now, failures.until)
        if turn - now > self.most_wait:
            return None
        failures.until = turn + min(self._step(failures.count), self.most_wait)  # a turn stays in reach
        return turn - now

    def failed(self, peer: str, user: str | None, now: float) -> None:
        """An attempt from `peer` (for `user`, when it named one) failed."""
        block = _block(peer)
        failures = self._note(self._peers, block)
        if failures.count >= self.free:
            failures.until = now + self._step(failures.count)
        if user is not None:
            self._note(self._users, user)

    def succeeded(self, peer: str, user: str) -> None:
        """An attempt from `peer` for `user` succeeded: both start afresh."""
        self._peers.pop(_block(peer), None)
        self._users.pop(user, None)

    def _step(self, count: int) -> float:
        """The back-off after `count` failures in a row (at least `free`)."""
        return min(self.most, self.first * 2.0 ** min(count - self.free, 64))

    def _note(self, table: OrderedDict[str, Failures], key: str) -> Failures:
        failures = table.pop(key, None) or Failures()
        failures.count += 1
        table[key] = failures  # the newest at the end: the least recently failed go first
        while len(table) > self._remembered:
            table.popitem(last=False)
        return failures


def _block(peer: str) -> str:
    """The key a peer counts under: its address, or its /64 for IPv6."""
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return peer  # the local socket, or a name
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)
