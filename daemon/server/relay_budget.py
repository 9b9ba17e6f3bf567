"""Each user's share of the bytes the server relays through channels (`poolctl exec`): one token
bucket per user, across all of the user's channels on this server, so that one user's fast output
(or input) cannot take the server's time from everyone else's requests and channels.

No I/O: the caller says what time it is and sleeps as told. A user may relay BURST bytes at once,
then RATE bytes a second; past that each relay waits its turn (the channel's windows then stop its
ends: nothing piles up here). Every byte is counted against its user (`relayed`), for the logs.
"""

from __future__ import annotations

from collections import Counter

RATE = 64 * 2**20  # bytes a second one user's channels relay, together, at most (after a burst)
BURST = 8 * 2**20  # bytes one user may relay at once


class RelayBudget:
    def __init__(self, rate: float = RATE, burst: float = BURST) -> None:
        self.rate = rate
        self.burst = burst
        self.relayed: Counter[str] = Counter()  # user -> bytes relayed, both ways
        self._buckets: dict[str, tuple[float, float]] = {}  # user -> (bytes of credit, as of when)

    def delay(self, user: str, size: int, now: float) -> float:
        """Count `size` bytes relayed for `user` at `now`: how many seconds to wait before relaying
        them (0.0: at once). The credit may go below zero: the wait is until it is back at zero,
        so a user's waits add up to what the rate allows, however many channels ask at once."""
        credit, at = self._buckets.get(user, (self.burst, now))
        credit = min(self.burst, credit + (now - at) * self.rate) - size
        self._buckets[user] = (credit, now)
        self.relayed[user] += size
        return 0.0 if credit >= 0 else -credit / self.rate
