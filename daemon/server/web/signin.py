"""Who is signed in to the dashboard: a pool token exchanged once for a browser session.

The token never travels again after sign-in: the browser holds a random session id in a cookie
(HttpOnly, SameSite=Strict, Secure under TLS) that expires with the session. Each session has its
own CSRF token, which every form that changes something carries back. Sessions live in the
server's memory: a restart signs everyone out, and there are at most MAX_SESSIONS (the oldest
goes first), so signing in again and again cannot grow the server.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

COOKIE = "gpupool_session"
LIFETIME = 12 * 3600.0  # seconds a session lasts from sign-in
MAX_SESSIONS = 10_000


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    user: str
    csrf: str
    expires: float  # Unix time


class Sessions:
    def __init__(self, lifetime: float = LIFETIME, most: int = MAX_SESSIONS) -> None:
        self.lifetime = lifetime
        self._most = most
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def open(self, user: str) -> Session:
        session = Session(
            secrets.token_urlsafe(32), user, secrets.token_urlsafe(32), time.time() + self.lifetime
        )
        self._sessions[session.id] = session
        while len(self._sessions) > self._most:
            self._sessions.popitem(last=False)
        return session

    def get(self, session_id: str | None) -> Session | None:
        session = self._sessions.get(session_id or "")
        if session is not None and session.expires <= time.time():
            del self._sessions[session.id]
            return None
        return session

    def close(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)


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
