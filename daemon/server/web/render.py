"""Templates to HTML: one Jinja2 environment, autoescaping everything, with the few filters the
pages share (times, durations, sizes). Templates and static files ship in the package: a page
fetches nothing from anywhere else."""

from __future__ import annotations

import datetime
import functools
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web

from daemon.server.web.guard import SIGNED_IN

HERE = Path(__file__).parent
NONE = "\u2013"  # an en dash: no value (yet)
STATIC = HERE / "static"


@functools.cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters |= {"when": when, "duration": duration, "size": size, "percent": percent}
    return env


def _context(request: web.Request, context: dict[str, Any]) -> dict[str, Any]:
    base: dict[str, Any] = {"me": None, "csrf": "", "path": request.path_qs}
    if (session := request.get(SIGNED_IN)) is not None:
        base |= {"me": session.user, "csrf": session.csrf}
    return base | context


def render_page(
    request: web.Request, template: str, context: dict[str, Any], status: int = 200
) -> web.Response:
    html = environment().get_template(template).render(_context(request, context))
    return web.Response(text=html, content_type="text/html", charset="utf-8", status=status)


def render_block(request: web.Request, template: str, block: str, context: dict[str, Any]) -> str:
    t = environment().get_template(template)
    return "".join(t.blocks[block](t.new_context(_context(request, context))))


def when(ts: float | None) -> str:
    """A Unix time in the server's zone, named (the reader may be elsewhere)."""
    if not ts:
        return NONE
    return datetime.datetime.fromtimestamp(ts).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def duration(seconds: float | None) -> str:
    if seconds is None:
        return NONE
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def size(n: float | None) -> str:
    if n is None:
        return NONE
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def percent(fraction: float | None) -> str:
    return NONE if fraction is None else f"{fraction * 100:.0f} %"
