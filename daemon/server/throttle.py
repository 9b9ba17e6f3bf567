"""Failed authentications slow the next ones: per peer address and per user name, with back-off.

One object, no I/O (the caller says what time it is), used by the wire handshake (listener.py and
session.py) and the dashboard's sign-in (web/app.py) alike, so a guesser gains nothing by
switching between them. Each address and each user name may fail FREE times; after that every
further failure doubles its back-off, from FIRST seconds up to MOST; a success from an address
forgets its failures, and a user name's are forgotten as they decay (below).

- A peer in back-off is refused before its token is looked at: the refusal is the same whether the
  token it would have sent is right or wrong, so it tells a guesser nothing new, and other peers
  are not affected (the real user, from their own machine, still gets in).
- A user name in back-off is slowed, not locked: attempts for it are answered one per back-off
  step (at most MOST_WAIT), however many arrive at once and from however many peers, each after
  waiting its turn (`wait`). The real user's attempt from a peer not known for them (below) waits
  too, then gets its answer; only when the turns of MOST_WAIT seconds ahead are all taken is an
  attempt refused, to be tried again.

A peer that authenticated as a user lately (the newest KNOWN per user) is known for that user:
the user's pacing never applies to it (OWASP's device cookie, by address), so a flood of guesses
naming alice from elsewhere cannot keep alice out from her own machine. Its own per-address
back-off still applies: a guesser sharing her address gains no guesses by it.

Failures are forgotten MOST seconds after their back-off ended (or, short of one, after the last):
a typo now and then never adds up. Memory is bounded: the newest REMEMBERED peers and user names
are kept, those not in back-off forgotten first (least recently failed first), so failures under
junk names or from ever new addresses do not wipe out a real back-off. IPv6 peers count by their
/64, the block one host is usually given.
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from dataclasses import dataclass

FREE = 5  # failures before the back-off begins
FIRST = 1.0  # seconds of the first back-off
MOST = 60.0  # seconds the back-off grows to at most; and how long after it ends it is remembered
MOST_WAIT = 10.0  # seconds an attempt for a user in back-off may wait for its turn
REMEMBERED = 4096  # peers, and user names, kept at most
KNOWN = 8  # peers remembered per user as having authenticated as them lately


@dataclass(slots=True)
class Failures:
    """What is known of one peer or one user name: its failures in a row, when the last was, and
    until when it waits (a peer: refused until then; a user: the next attempt's turn)."""

    count: int = 0
    last: float = 0.0
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
        known: int = KNOWN,
    ) -> None:
        self.free, self.first, self.most, self.most_wait = free, first, most, most_wait
        self._remembered, self._known_per_user = remembered, known
        self._peers: OrderedDict[str, Failures] = OrderedDict()
        self._users: OrderedDict[str, Failures] = OrderedDict()
        self._known: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()  # user -> their peers

    def refused(self, peer: str, now: float) -> float:
        """Seconds until `peer` may try again; 0 when it may now."""
        failures = self._current(self._peers, block(peer), now)
        return max(0.0, failures.until - now) if failures is not None else 0.0

    def wait(self, peer: str, user: str, now: float) -> float | None:
        """Seconds an attempt from `peer` for `user` waits for its answer (0: none), its turn taken;
        None when its turn is further off than `most_wait` (refused: try again later). A peer that
        authenticated as `user` lately never waits for them: a flood of guesses naming a user from
        elsewhere does not keep that user out of their own machine."""
        failures = self._current(self._users, user, now)
        if failures is None or failures.count < self.free or self.known(peer, user):
            return 0.0
        turn = max(now, failures.until)
        if turn - now > self.most_wait:
            return None
        failures.until = turn + min(self._step(failures.count), self.most_wait)  # a turn stays in reach
        return turn - now

    def failed(self, peer: str, user: str | None, now: float) -> None:
        """An attempt from `peer` (for `user`, when it named one) failed."""
        failures = self._note(self._peers, block(peer), now)
        if failures.count >= self.free:
            failures.until = now + self._step(failures.count)
        if user is not None:
            self._note(self._users, user, now)

    def succeeded(self, peer: str, user: str) -> None:
        """An attempt from `peer` for `user` succeeded: the peer starts afresh, and is known for
        `user` from now on (`wait`). The user's failures stay, to decay: the real user getting in
        says nothing of the guesses naming them from elsewhere, and were it to forget them each
        of their sign-ins would give a guesser FREE more."""
        self._peers.pop(block(peer), None)
        self.know(peer, user)

    def know(self, peer: str, user: str, *, keep: int | None = None) -> None:
        """Remember `peer` as one that authenticated as `user` (the newest `keep` kept for that
        name, `known` by default)."""
        peers = self._known.pop(user, None) or OrderedDict()
        peers.pop(block(peer), None)
        peers[block(peer)] = None
        while len(peers) > (keep or self._known_per_user):
            peers.popitem(last=False)
        self._known[user] = peers
        while len(self._known) > self._remembered:
            self._known.popitem(last=False)

    def known(self, peer: str, user: str) -> bool:
        """Whether `peer` authenticated as `user` lately."""
        return block(peer) in self._known.get(user, ())

    def _step(self, count: int) -> float:
        """The back-off after `count` failures in a row (at least `free`)."""
        return min(self.most, self.first * 2.0 ** min(count - self.free, 64))

    def _current(self, table: OrderedDict[str, Failures], key: str, now: float) -> Failures | None:
        """`key`'s failures, unless its back-off ended (or its last failure was) over `most` ago:
        then they are forgotten, and a month of typos does not add up to a back-off."""
        failures = table.get(key)
        if failures is not None and now - max(failures.last, failures.until) > self.most:
            del table[key]
            return None
        return failures

    def _note(self, table: OrderedDict[str, Failures], key: str, now: float) -> Failures:
        failures = self._current(table, key, now)
        table.pop(key, None)
        failures = failures or Failures()
        failures.count += 1
        failures.last = now
        table[key] = failures  # the newest at the end: the least recently failed go first
        if len(table) > self._remembered:
            self._forget_one(table, key, now)
        return failures

    def _forget_one(self, table: OrderedDict[str, Failures], newest: str, now: float) -> None:
        """Forget the least recently failed entry not in back-off, other than `newest` (failures
        from ever new addresses or under junk names must not wipe out a real back-off, nor a
        full table let one peer fail uncounted); the oldest when all others are in back-off."""
        for key, failures in table.items():
            backing_off = (
                failures.count >= self.free and now - max(failures.last, failures.until) <= self.most
            )
            if not backing_off and key != newest:
                del table[key]
                return
        table.popitem(last=False)


def block(peer: str) -> str:
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
