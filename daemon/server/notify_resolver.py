"""The name lookup of users' webhooks: each name resolved once, and only the addresses a hook may
reach (webhook_targets.Allowed) handed to the connection.

Judging a URL's name and then letting the HTTP client look it up again would leave a gap a DNS
server the user controls can fill with another answer (DNS rebinding: public when judged,
127.0.0.1 when connected to). So the judging is the lookup: the client's connector asks this
resolver, and connects to exactly the addresses it returns; TLS still checks the certificate
against the URL's name. An address written in the URL is never looked up (the client takes it as
it is): the notifier judges it itself before the POST.
"""

from __future__ import annotations

import socket
from ipaddress import ip_address

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

from daemon.webhook_targets import Allowed


class TargetRefused(OSError):
    """Every address a hook's name resolves to is one it may not reach."""

    def __init__(self, host: str, refused: list[tuple[str, str]]) -> None:
        shown = ", ".join(f"{address} ({what})" for address, what in refused)
        super().__init__(f"{host} resolves to {shown} only")


class CheckedResolver(AbstractResolver):
    """Resolves with the system's resolver (getaddrinfo, in a thread), then keeps the addresses
    `allowed` allows; TargetRefused when none is left. A name the operator trusts keeps all."""

    def __init__(self, allowed: Allowed) -> None:
        self.allowed = allowed
        self._inner = ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        if self.allowed.trusts(host):
            return found
        kept: list[ResolveResult] = []
        refused: list[tuple[str, str]] = []
        for result in found:
            what = self.allowed.refusal(ip_address(result["host"]))
            if what:
                refused.append((result["host"], what))
            else:
                kept.append(result)
        if refused and not kept:
            raise TargetRefused(host, refused)
        return kept

    async def close(self) -> None:
        await self._inner.close()
