"""Who is signed in to the dashboard: a pool token exchanged once for a browser session.

The token never travels again after sign-in: the browser holds a random session id in a cookie
(HttpOnly, SameSite=Strict, Secure under TLS) that expires with the session. Each session has its
own CSRF token, which every form that changes something carries back. Sessions live in the
server's memory: a restart signs everyone out. A user has at most MAX_SESSIONS_PER_USER: their
next sign-in ends their own oldest session, never another user's, so one user signing in again
and again can neither grow the server nor sign anyone else out. Past MAX_SESSIONS in all (as many
users as that takes, each with their own most) the oldest of all goes first.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass

COOKIE = "gpupool_session"
LIFETIME = 12 * 3600.0  # seconds a session lasts from sign-in
MAX_SESSIONS = 10_000
MAX_SESSIONS_PER_USER = 32  # browsers and devices one person signs in from, with room to spare


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    user: str
    csrf: str
    expires: float  # Unix time


class Sessions:
    def __init__(
        self, lifetime: float = LIFETIME, most: int = MAX_SESSIONS, most_per_user: int = MAX_SESSIONS_PER_USER
    ) -> None:
        self.lifetime = lifetime
        self.most = most
        self.most_per_user = most_per_user
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # oldest first
        self._of_user: Counter[str] = Counter()  # how many of them each user has

    def open(self, user: str) -> Session:
        session = Session(
            secrets.token_urlsafe(32), user, secrets.token_urlsafe(32), time.time() + self.lifetime
        )
        if self._of_user[user] >= self.most_per_user:
            self.close(next(s.id for s in self._sessions.values() if s.user == user))  # their oldest
        self._sessions[session.id] = session
        self._of_user[user] += 1
        while len(self._sessions) > self.most:
            self.close(next(iter(self._sessions)))
        return session

    def get(self, session_id: str | None) -> Session | None:
        session = self._sessions.get(session_id or "")
        if session is not None and session.expires <= time.time():
            self.close(session.id)
            return None
        return session

    def sign_out(self, users: Collection[str]) -> int:
        """End every session of `users` (their tokens were taken back); how many."""
        ended = [s.id for s in self._sessions.values() if s.user in users]
        for session_id in ended:
            self.close(session_id)
        return len(ended)

    def close(self, session_id: str) -> None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._of_user[session.user] -= 1
            if not self._of_user[session.user]:
                del self._of_user[session.user]


def user_of_token(tokens: Mapping[str, bytes], token: str) -> str | None:
    """The user whose token `token` is, compared in constant time with every user's, or None."""
    given = token.strip().encode()
    found = None
    for user, known in tokens.items():
        if hmac.compare_digest(given, known) and given:
            found = user
    return found


def same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())
