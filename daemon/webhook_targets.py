"""Which addresses a user's job-end notification may reach (`--notify URL`; config `notify_allow`).

A user's `--notify` URL has the server POST from inside the pool's network to wherever the user
says. Left open, a user reaches the server's own loopback services (its metrics, its Redis), the
cloud's metadata service (169.254.169.254) and anything on the internal network, and learns from
the outcome whether they answered. So a user's hook goes to public addresses only: never to a
loopback, private (RFC 1918, IPv6 ULA), link-local, multicast, unspecified, shared (100.64.0.0/10)
or reserved address, nor to an IPv6 address that stands for one of those (IPv4-mapped, NAT64,
6to4), unless the operator allows more: `notify_allow` lists networks (CIDR) and host names the
operator trusts, whose hooks go wherever they resolve. The pool's own `notify_url` is the
operator's, and goes where it points.

The host judged is the one the HTTP client connects to (yarl's, after IDNA mapping: "127。0。0。1"
is 127.0.0.1 to it, though not to urllib's parser), never a parse of the URL's own.

No I/O here: the server judges an address written in the URL when the job is enqueued and again
at delivery, and every address a name resolves to at delivery (server/notify_resolver.py, which
hands the connection only the addresses it judged), with the same `Allowed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network

from yarl import URL

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network

SHARED = ip_network("100.64.0.0/10")  # carrier-grade NAT: inside some provider's network
NAT64 = ip_network("64:ff9b::/96")  # the well-known NAT64 prefix: the IPv4 address in its last bits
OPTION = "notify_allow"
EXAMPLE = "127.0.0.1/32, 10.0.0.0/8, hooks.lab.internal"


def kind(ip: IPAddress) -> str:
    """What `ip` is when it is not a public unicast address ("loopback", "private", ...); "" when
    it is one."""
    if isinstance(ip, IPv6Address):
        if ip.ipv4_mapped is not None:  # ::ffff:a.b.c.d is a.b.c.d to a dual-stack socket
            return kind(ip.ipv4_mapped)
        if ip in NAT64:  # a NAT64 gateway goes on to the IPv4 address it carries
            return kind(IPv4Address(int(ip) & 0xFFFF_FFFF))
        if ip.sixtofour is not None and (inner := kind(ip.sixtofour)):
            return inner
    for name, yes in (
        ("unspecified", ip.is_unspecified),
        ("loopback", ip.is_loopback),
        ("link-local", ip.is_link_local),
        ("multicast", ip.is_multicast),
        ("shared (100.64.0.0/10)", ip in SHARED),
        ("private", ip.is_private),
        ("reserved", ip.is_reserved),
    ):
        if yes:
            return name
    return "" if ip.is_global else "non-public"


def looks_like_address(host: str) -> bool:
    """Whether an HTTP client takes `host` for an address rather than a name to look up (aiohttp's
    rule: any colon, or only digits and dots): such a host is judged as written, never resolved."""
    return ":" in host or host.replace(".", "").isdigit()


@dataclass(frozen=True, slots=True)
class Allowed:
    """The operator's `notify_allow`: networks whose addresses a hook may reach, and names whose
    hooks may go wherever they resolve, besides every public address."""

    networks: tuple[IPNetwork, ...] = ()
    names: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, entries: Sequence[str]) -> Allowed:
        """`notify_allow`'s entries: a network ("10.0.0.0/8"), an address (a network of one) or a
        host name; ValueError naming the first that is none of them."""
        networks: list[IPNetwork] = []
        names: set[str] = set()
        for entry in entries:
            text = entry.strip()
            if "/" in text or looks_like_address(text):
                try:
                    networks.append(ip_network(text))
                except ValueError as exc:
                    why = f"{entry!r}: {exc}; expected networks or host names, e.g. {EXAMPLE}"
                    raise ValueError(why) from None
            elif text and not any(c.isspace() or c in "@[]?#" for c in text):
                names.add(_name(text))
            else:
                raise ValueError(f"{entry!r} is neither a network nor a host name, e.g. {EXAMPLE}")
        return cls(tuple(networks), frozenset(names))

    def trusts(self, host: str) -> bool:
        """Whether `host` is a name the operator listed: its hooks go wherever it resolves."""
        return _name(host) in self.names

    def refusal(self, ip: IPAddress) -> str:
        """What `ip` is when a hook may not reach it ("loopback", ...); "" when it may."""
        what = kind(ip)
        if not what:
            return ""
        plain = ip.ipv4_mapped or ip if isinstance(ip, IPv6Address) else ip
        if any(plain in net or ip in net for net in self.networks):
            return ""
        return what

    def url_refusal(self, url: str) -> str:
        """Why a hook to `url` is refused before any name is looked up (its host is an address that
        may not be reached), as a clause: "127.0.0.1 is a loopback address"; "" when it is not
        (a name is judged at delivery, by each address it resolves to)."""
        host = client_host(url)
        if not looks_like_address(host) or self.trusts(host):
            return ""
        try:
            ip = ip_address(host)
        except ValueError:
            return f"{host} is not an address in its usual form"
        what = self.refusal(ip)
        return f"{ip} is a{'n' if what[:1] in 'aeiou' else ''} {what} address" if what else ""


def client_host(url: str) -> str:
    """The host of `url` as aiohttp connects to it (yarl's raw_host, IDNA-encoded); "" when the URL
    has none or yarl cannot read it."""
    try:
        return URL(url).raw_host or ""
    except ValueError:
        return ""


def _name(host: str) -> str:
    return host.lower().rstrip(".")
