"""The dashboard over plain HTTP, as a hostile or careless client meets it: a real pool server on
the test's Redis, a real worker running real processes, users with tokens, and aiohttp's client
(no browser, no mocks).

Each test is one promise docs/SECURITY.md makes for the dashboard: every answer carries the strict
Content-Security-Policy and no page needs it loosened; the session cookie cannot be read by a
script, sent by another site or sent in clear under TLS; no session, no page; no form without the
session's CSRF token, nor from another site; no answer for a Host that is not this server's (DNS
rebinding); a user acts on and reads only their own jobs, as poolctl does; sign-in sends nowhere
but this server; sign-out ends the session; beyond loopback only with tokens; the live views stream
and are limited per user.
"""

from __future__ import annotations

import asyncio
import html
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from daemon.job import JobState
from daemon.object_store import artifact_prefix
from daemon.queue.embedded_redis import EmbeddedRedis
from daemon.queue.terminal_events import JobEvents
from daemon.server import handlers as handlers_module
from daemon.server.handlers import Handlers
from daemon.server.listener import ListenerError
from daemon.server.web import live as live_module
from daemon.server.web.app import WebServer
from daemon.server.web.snapshot import Snapshots
from storage.local import LocalStore
from tests.support.pool import Pool, running_pool
from tests.support.workers import running_worker, sh, wait_state, wait_until

pytestmark = pytest.mark.timeout(60)

COOKIE = "gpupool_session"
CSRF = re.compile(r'<input type="hidden" name="csrf" value="([^"]+)">')
SECRET = "wandb-0123456789abcdef"
SSE = {"Accept": "text/event-stream"}
FOREIGN_HOSTS = (
    "evil.example",
    "rebound.example:{port}",
    "127.0.0.1.evil.example:{port}",
    "localhost.evil.example",
)


# -- helpers ---------------------------------------------------------------------------------------


def base(pool: Pool) -> str:
    assert pool.server.web is not None
    return pool.server.web.address


def port(pool: Pool) -> int:
    assert pool.server.web is not None
    return pool.server.web.port


def client(cookies: dict[str, str] | None = None) -> aiohttp.ClientSession:
    """A browser-like client: keeps cookies for 127.0.0.1, gives up on any answer after 10 s."""
    return aiohttp.ClientSession(
        cookie_jar=aiohttp.CookieJar(unsafe=True), timeout=aiohttp.ClientTimeout(total=10), cookies=cookies
    )


def csrf_of(html: str) -> str:
    found = CSRF.search(html)
    assert found is not None, html
    return found.group(1)


async def sign_in(http: aiohttp.ClientSession, pool: Pool, user: str) -> str:
    """Sign `http` in as `user`; the session's CSRF token, as the signed-in page carries it."""
    async with http.post(
        f"{base(pool)}/signin", data={"token": pool.tokens[user]}, allow_redirects=False
    ) as r:
        assert r.status == 303, await r.text()
    async with http.get(f"{base(pool)}/") as r:
        assert r.status == 200
        html = await r.text()
    assert f'<span id="me">{user}</span>' in html
    return csrf_of(html)


def cookie_attributes(response: aiohttp.ClientResponse) -> dict[str, str]:
    """The attributes of the Set-Cookie header that sets the session cookie (lower-cased names)."""
    for header in response.headers.getall("Set-Cookie", []):
        first, *rest = (part.strip() for part in header.split(";"))
        if first.startswith(f"{COOKIE}="):
            attributes = {"value": first.partition("=")[2]}
            for attribute in rest:
                name, _, value = attribute.partition("=")
                attributes[name.lower()] = value
            return attributes
    raise AssertionError(f"no {COOKIE} cookie set: {response.headers.getall('Set-Cookie', [])}")


async def first_event(response: aiohttp.ClientResponse, seconds: float = 5.0) -> str:
    """The data of the first event (not a comment) on an event stream, read within `seconds`."""
    data: list[str] = []
    async with asyncio.timeout(seconds):
        async for raw in response.content:
            line = raw.decode().rstrip("\r\n")
            if line.startswith("data:"):
                data.append(line.removeprefix("data:").removeprefix(" "))
            elif not line and data:
                return "\n".join(data)
    raise AssertionError("the event stream ended before its first event")


def assert_guarded(response: aiohttp.ClientResponse) -> None:
    """The headers every dashboard answer carries, whatever it is."""
    what = f"{response.method} {response.url.path} ({response.status})"
    csp = response.headers.get("Content-Security-Policy", "")
    directives = {d.split()[0]: d.split()[1:] for d in csp.split(";") if d.strip()}
    assert directives.get("script-src") == ["'self'"], (what, csp)
    assert directives.get("frame-ancestors") == ["'none'"], (what, csp)
    assert directives.get("default-src") == ["'none'"], (what, csp)
    assert "unsafe-inline" not in csp, (what, csp)
    assert "unsafe-eval" not in csp, (what, csp)
    assert response.headers.get("X-Content-Type-Options") == "nosniff", what


@dataclass
class Busy:
    """A pool with a worker and a job of alice's running (with a secret in its environment)."""

    pool: Pool
    job_id: str
    worker_id: str


@asynccontextmanager
async def busy_pool(redis_server: EmbeddedRedis, tmp: Path) -> AsyncIterator[Busy]:
    async with (
        running_pool(
            redis_server,
            tmp,
            store=LocalStore(tmp / "store"),
            users=("alice", "bob", "carol"),
            admins=("carol",),
        ) as pool,
        running_worker(pool.queue, tmp / "w", slots=2) as worker,
    ):
        job_id, _ = await pool.queue.enqueue(
            sh("echo started; sleep 60", user="alice", env={"WANDB_API_KEY": SECRET})
        )
        await wait_state(pool.queue, job_id, JobState.RUNNING)
        yield Busy(pool, job_id, worker.id)


@pytest.fixture
async def busy(redis_server: EmbeddedRedis, tmp_path: Path) -> AsyncIterator[Busy]:
    async with busy_pool(redis_server, tmp_path) as b:
        yield b


async def cancels(
    http: aiohttp.ClientSession, pool: Pool, job: str, csrf: str, headers: dict[str, str] | None = None
) -> None:
    """The cancel form, sent with this session's token, is taken: back to the job's page, and the
    job ends cancelled."""
    url = f"{base(pool)}/jobs/{job}/cancel"
    async with http.post(url, data={"csrf": csrf}, headers=headers or {}, allow_redirects=False) as r:
        assert r.status == 303, await r.text()
        assert r.headers["Location"] == f"/jobs/{job}"
    await wait_state(pool.queue, job, JobState.CANCELLED, timeout=10.0)


async def still_running(busy: Busy) -> bool:
    return (await busy.pool.queue.get(busy.job_id)).state is JobState.RUNNING


# -- 1. the Content-Security-Policy, on every answer and needed by no page -------------------------


async def test_every_answer_carries_the_strict_content_security_policy(busy: Busy) -> None:
    pool, job = busy.pool, busy.job_id
    url = base(pool)
    async with client() as anonymous:
        for path in ("/signin", "/static/gpupool.css", "/static/gpupool.js", "/static/none.css"):
            async with anonymous.get(url + path) as r:
                assert_guarded(r)
        async with anonymous.get(url + "/", allow_redirects=False) as r:  # sent to sign in
            assert r.status == 303
            assert_guarded(r)
        async with anonymous.get(url + "/live/jobs", headers=SSE) as r:
            assert r.status == 401
            assert_guarded(r)
        async with anonymous.post(url + "/signin", data={"token": "wrong"}) as r:
            assert r.status == 401
            assert_guarded(r)
        async with anonymous.get(url + "/signin", headers={"Host": "evil.example"}) as r:
            assert r.status == 421
            assert_guarded(r)
    async with client() as bob:
        csrf = await sign_in(bob, pool, "bob")
        for path in ("/", "/jobs", f"/jobs/{job}", f"/workers/{busy.worker_id}", "/jobs/nope", "/nowhere"):
            async with bob.get(url + path) as r:
                assert_guarded(r)
        async with bob.post(url + f"/jobs/{job}/cancel", data={"csrf": csrf}) as r:  # not his
            assert r.status == 403
            assert_guarded(r)
        async with bob.post(url + f"/jobs/{job}/cancel") as r:  # no CSRF token
            assert r.status == 403
            assert_guarded(r)
        async with bob.get(url + f"/jobs/{job}/log", headers=SSE) as r:
            assert r.status == 403
            assert_guarded(r)
        # The event streams too: they are answers of their own, prepared before the guard sees them.
        for path in (f"/live/jobs/{job}", "/live/jobs"):
            async with bob.get(url + path, headers=SSE) as r:
                assert r.status == 200
                assert r.content_type == "text/event-stream"
                assert_guarded(r)
    async with client() as alice:
        await sign_in(alice, pool, "alice")
        async with alice.get(url + f"/jobs/{job}/log", headers=SSE) as r:
            assert r.status == 200
            assert_guarded(r)


SCRIPT = re.compile(r"<script\b([^>]*)>(.*?)</script\s*>", re.IGNORECASE | re.DOTALL)
URL_ATTRIBUTE = re.compile(
    r"""\s(?:src|href|action|formaction|data-live|data-log)\s*=\s*["']([^"']*)["']""", re.I
)


def assert_no_inline_code_or_foreign_urls(path: str, html: str) -> None:
    scripts = SCRIPT.findall(html)
    assert scripts, (path, "the page's own script is missing")
    for attributes, body in scripts:
        assert body.strip() == "", (path, "an inline script", body)
        assert re.search(r'\ssrc="/[^/]', attributes), (path, "a script not from this server", attributes)
    assert not re.search(r"\sstyle\s*=", html, re.IGNORECASE), (path, "a style= attribute")
    assert not re.search(r"<style\b", html, re.IGNORECASE), (path, "a <style> element")
    assert not re.search(r"\son[a-z]+\s*=", html, re.IGNORECASE), (path, "an event-handler attribute")
    assert not re.search(r"javascript:", html, re.IGNORECASE), (path, "a javascript: URL")
    assert not re.search(r"https?://", html, re.IGNORECASE), (path, "a URL with a scheme")
    for value in URL_ATTRIBUTE.findall(html):
        assert value.startswith("/"), (path, "a URL not on this server", value)
        assert not value.startswith("//"), (path, "a URL to another host", value)


async def test_no_page_has_inline_script_inline_style_or_a_url_to_another_host(busy: Busy) -> None:
    pool, job = busy.pool, busy.job_id
    url = base(pool)
    async with client() as anonymous, anonymous.get(url + "/signin?next=/jobs") as r:
        assert r.status == 200
        assert_no_inline_code_or_foreign_urls("/signin", await r.text())
    for user in ("alice", "bob"):  # the owner's page has a cancel form and a log; another's has not
        async with client() as http:
            await sign_in(http, pool, user)
            for path in (
                "/",
                "/jobs",
                "/jobs?user=alice&sort=user",
                f"/jobs/{job}",
                f"/workers/{busy.worker_id}",
            ):
                async with http.get(url + path) as r:
                    assert r.status == 200, (path, await r.text())
                    assert_no_inline_code_or_foreign_urls(path, await r.text())
            async with http.get(url + "/jobs/default.nosuchjob0") as r:  # an error page
                assert r.status == 404
                assert_no_inline_code_or_foreign_urls("/jobs/default.nosuchjob0", await r.text())
    async with client() as anonymous:
        for path in ("/static/gpupool.css", "/static/gpupool.js"):
            async with anonymous.get(url + path) as r:
                assert r.status == 200
                assert not re.search(r"https?://|url\(\s*['\"]?//", await r.text()), path


async def test_a_job_that_carries_markup_shows_it_as_text(busy: Busy) -> None:
    """A job's name, command and environment are the submitter's: pages show them escaped."""
    pool = busy.pool
    markup = "<script>alert(1)</script>"
    job_id, _ = await pool.queue.enqueue(
        sh(f"echo '{markup}'; sleep 60", user="bob", name=markup, env={"X": "<img src=x onerror=alert(1)>"})
    )
    async with client() as bob:
        await sign_in(bob, pool, "bob")
        for path in (f"/jobs/{job_id}", "/jobs", f"/live/jobs/{job_id}"):
            async with bob.get(base(pool) + path, headers=SSE if path.startswith("/live") else {}) as r:
                assert r.status == 200, path
                html = await first_event(r) if path.startswith("/live") else await r.text()
            assert markup not in html, path
            assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html, path
            assert "<img" not in html, path


# -- 2. the session cookie -------------------------------------------------------------------------


async def test_sign_in_sets_an_httponly_strict_expiring_cookie_not_secure_on_plain_http(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    async with running_pool(redis_server, tmp_path) as pool, client() as http:
        assert base(pool).startswith("http://")
        async with http.post(
            base(pool) + "/signin", data={"token": pool.tokens["alice"]}, allow_redirects=False
        ) as r:
            assert r.status == 303
            assert r.headers["Location"] == "/"
            cookie = cookie_attributes(r)
        assert len(cookie["value"]) >= 32
        assert "httponly" in cookie
        assert cookie["samesite"].lower() == "strict"
        assert int(cookie["max-age"]) > 0
        assert cookie.get("path") == "/"
        assert "secure" not in cookie  # a browser would not send it back over http


async def test_under_tls_the_session_cookie_is_secure(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    async with running_pool(redis_server, tmp_path, tls="on") as pool, client() as http:
        assert base(pool).startswith("https://")
        async with http.post(
            base(pool) + "/signin", data={"token": pool.tokens["alice"]}, allow_redirects=False, ssl=False
        ) as r:
            assert r.status == 303
            cookie = cookie_attributes(r)
            assert_guarded(r)
        assert "secure" in cookie
        assert "httponly" in cookie
        assert cookie["samesite"].lower() == "strict"
        async with http.get(base(pool) + "/", ssl=False) as r:  # and it opens pages, over TLS
            assert r.status == 200
            assert '<span id="me">alice</span>' in await r.text()


async def test_a_wrong_token_is_401_and_sets_no_cookie(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    async with running_pool(redis_server, tmp_path) as pool, client() as http:
        for form in (
            {"token": "not-a-token"},
            {"token": ""},
            {"token": pool.tokens["alice"] + "x"},
            {"user": "alice"},
        ):
            async with http.post(base(pool) + "/signin", data=form, allow_redirects=False) as r:
                assert r.status == 401, form
                assert "Set-Cookie" not in r.headers, form
                assert "not one this pool knows" in await r.text()
        assert not list(http.cookie_jar)
        async with http.get(base(pool) + "/", allow_redirects=False) as r:
            assert r.status == 303


async def test_one_users_sign_ins_end_only_their_own_oldest_sessions(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """issue 44 item 9: any signed-in user signed everyone out by signing in past the bound on all
    sessions (10 001 sign-ins). Now bob's sign-ins past his own bound end bob's oldest session and
    no one else's; here the bound on all sessions is made small, so bob passes it too."""
    async with running_pool(redis_server, tmp_path) as pool, client() as alice:
        assert pool.server.web is not None
        sessions = pool.server.web.sessions
        sessions.most, sessions.most_per_user = 2 * sessions.most_per_user, 4
        await sign_in(alice, pool, "alice")
        cookies = []
        async with client() as bob:
            for _ in range(sessions.most + 1):
                async with bob.post(
                    base(pool) + "/signin", data={"token": pool.tokens["bob"]}, allow_redirects=False
                ) as r:
                    assert r.status == 303
                    cookies.append(cookie_attributes(r)["value"])
        async with alice.get(base(pool) + "/", allow_redirects=False) as r:
            assert r.status == 200, "bob's sign-ins signed alice out"
        for cookie, kept in ((cookies[0], False), (cookies[-4], True), (cookies[-5], False)):
            async with client({COOKIE: cookie}) as bob, bob.get(base(pool) + "/", allow_redirects=False) as r:
                assert r.status == (200 if kept else 303)


# -- 3. no session, no page ------------------------------------------------------------------------


async def test_without_a_session_pages_redirect_and_streams_and_forms_are_refused(busy: Busy) -> None:
    pool, job = busy.pool, busy.job_id
    url = base(pool)
    async with client() as http:
        async with http.get(url + "/", allow_redirects=False) as r:
            assert r.status == 303
            assert r.headers["Location"] == "/signin?next=/"
        for path in ("/live/", "/live/jobs", f"/live/jobs/{job}", f"/jobs/{job}/log"):
            async with http.get(url + path, headers=SSE, allow_redirects=False) as r:
                assert r.status == 401, path
        async with http.post(url + f"/jobs/{job}/cancel", data={"csrf": "guess"}, allow_redirects=False) as r:
            assert r.status in (401, 303)
        async with http.get(
            url + f"/jobs/{job}/artifact?key=artifacts/{job}/1/x", allow_redirects=False
        ) as r:
            assert r.status == 303
            assert r.headers["Location"].startswith("/signin?next=")
        # A made-up session id is no session.
        http.cookie_jar.update_cookies({COOKIE: "A" * 43})
        async with http.get(url + "/jobs", allow_redirects=False) as r:
            assert r.status == 303
    assert await still_running(busy)


async def test_the_page_asked_for_before_sign_in_is_the_page_after_it(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """A filtered job list with two parameters survives the trip through the sign-in page whole."""
    async with running_pool(redis_server, tmp_path) as pool, client() as http:
        async with http.get(base(pool) + "/jobs?user=alice&state=running") as r:  # follows to sign-in
            assert r.url.path == "/signin"
            assert r.status == 200
            signin_url = r.url
        async with http.post(signin_url, data={"token": pool.tokens["alice"]}, allow_redirects=False) as r:
            assert r.status == 303
            assert r.headers["Location"] == "/jobs?user=alice&state=running"


# -- 4. CSRF and Origin ----------------------------------------------------------------------------


async def test_a_form_without_this_sessions_csrf_token_changes_nothing(busy: Busy) -> None:
    pool, job = busy.pool, busy.job_id
    cancel = f"{base(pool)}/jobs/{job}/cancel"
    async with client() as alice, client() as alice_elsewhere:
        csrf = await sign_in(alice, pool, "alice")
        other_csrf = await sign_in(alice_elsewhere, pool, "alice")  # her own other session's token
        assert other_csrf != csrf
        for form in ({}, {"csrf": ""}, {"csrf": other_csrf}, {"csrf": csrf[:-1]}):
            async with alice.post(cancel, data=form, allow_redirects=False) as r:
                assert r.status == 403, form
                assert "reload the page" in await r.text()
        async with alice.post(cancel, json={"csrf": csrf}, allow_redirects=False) as r:  # not a form
            assert r.status == 403
        async with alice.post(
            cancel, data={"csrf": csrf}, headers={"Origin": "http://evil.example"}, allow_redirects=False
        ) as r:
            assert r.status == 403
        async with alice.post(
            cancel, data={"csrf": csrf}, headers={"Origin": "null"}, allow_redirects=False
        ) as r:
            assert r.status == 403  # a sandboxed frame's, or a redirect's from elsewhere
        assert await still_running(busy)

        await cancels(alice, pool, job, csrf, headers={"Origin": base(pool)})


# -- 5. the Host header (DNS rebinding) ------------------------------------------------------------


async def test_a_foreign_host_gets_421_on_every_route(busy: Busy) -> None:
    pool, job = busy.pool, busy.job_id
    url = base(pool)
    async with client() as alice:
        csrf = await sign_in(alice, pool, "alice")
        token = pool.tokens["alice"]
        for host in (h.format(port=port(pool)) for h in FOREIGN_HOSTS):
            headers = {"Host": host}
            for path in ("/", "/signin", "/static/gpupool.css", "/jobs", f"/jobs/{job}", "/nowhere"):
                async with alice.get(url + path, headers=headers, allow_redirects=False) as r:
                    assert r.status == 421, (host, path)
                    assert "does not answer for the host" in await r.text()
            for path in ("/live/jobs", f"/jobs/{job}/log"):
                async with alice.get(url + path, headers=headers | SSE) as r:
                    assert r.status == 421, (host, path)
            async with alice.post(
                url + "/signin", data={"token": token}, headers=headers, allow_redirects=False
            ) as r:
                assert r.status == 421
                assert "Set-Cookie" not in r.headers  # the rebound site gets no session either
            async with alice.post(url + f"/jobs/{job}/cancel", data={"csrf": csrf}, headers=headers) as r:
                assert r.status == 421
    assert await still_running(busy)


async def test_this_servers_own_names_and_web_hosts_are_served(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    async with running_pool(redis_server, tmp_path, web_hosts=["pool.lab"]) as pool, client() as http:
        p = port(pool)
        for host in (
            f"localhost:{p}",
            f"127.0.0.1:{p}",
            "localhost",
            f"pool.lab:{p}",
            f"POOL.lab:{p}",
            "pool.lab",
        ):
            async with http.get(base(pool) + "/signin", headers={"Host": host}) as r:
                assert r.status == 200, host
        async with http.get(base(pool) + "/signin", headers={"Host": f"other.lab:{p}"}) as r:
            assert r.status == 421


# -- 6. who may do what ----------------------------------------------------------------------------


async def test_bob_can_neither_cancel_nor_read_alices_job_but_an_admin_can_cancel_it(busy: Busy) -> None:
    pool, job = busy.pool, busy.job_id
    url = base(pool)
    async with client() as bob:
        csrf = await sign_in(bob, pool, "bob")
        async with bob.post(f"{url}/jobs/{job}/cancel", data={"csrf": csrf}, allow_redirects=False) as r:
            assert r.status == 403
            text = await r.text()
            assert "belongs to alice" in text
            assert "admin" in text
        assert await still_running(busy)

        async with bob.get(f"{url}/jobs/{job}") as r:
            assert r.status == 200
            page = await r.text()
        assert "WANDB_API_KEY" in page
        assert SECRET not in page
        assert 'id="cancel"' not in page
        assert "/cancel" not in page
        assert f'data-log="/jobs/{job}/log"' not in page

        async with bob.get(f"{url}/jobs/{job}/log", headers=SSE) as r:
            assert r.status == 403
            assert "belongs to alice" in await r.text()
        async with bob.get(f"{url}/live/jobs/{job}", headers=SSE) as r:  # the live view hides it too
            assert r.status == 200
            assert SECRET not in await first_event(r)

    async with client() as alice:  # her own page shows her the value
        await sign_in(alice, pool, "alice")
        async with alice.get(f"{url}/jobs/{job}") as r:
            assert SECRET in await r.text()

    async with client() as carol:  # an admin may cancel anyone's job
        csrf = await sign_in(carol, pool, "carol")
        await cancels(carol, pool, job, csrf)


async def test_only_the_owner_downloads_a_jobs_artifact_and_only_the_jobs_own(busy: Busy) -> None:
    pool, job = busy.pool, busy.job_id
    url = base(pool)
    key = artifact_prefix(job, "w1/3.1") + "x"  # named by its attempt's lease id, as a worker names it
    await pool.server.store.put_bytes(key, b"alice's weights")
    await pool.server.store.put_bytes("datasets/x", b"someone's data")
    async with client() as bob:
        await sign_in(bob, pool, "bob")
        async with bob.get(f"{url}/jobs/{job}/artifact", params={"key": key}) as r:
            assert r.status == 403
            assert b"alice's weights" not in await r.read()
    async with client() as alice:
        await sign_in(alice, pool, "alice")
        async with alice.get(f"{url}/jobs/{job}/artifact", params={"key": key}) as r:
            assert r.status == 200
            assert await r.read() == b"alice's weights"
            assert r.headers["Content-Disposition"] == 'attachment; filename="x"'
            assert_guarded(r)
        for other in ("datasets/x", f"artifacts/{job}x/1/x", f"artifacts/{job}/../../datasets/x"):
            async with alice.get(f"{url}/jobs/{job}/artifact", params={"key": other}) as r:
                assert 400 <= r.status < 600, other
                assert b"someone's data" not in await r.read()
        async with alice.get(f"{url}/jobs/{job}/artifact", params={"key": "datasets/x"}) as r:
            assert r.status == 400
            assert "is not an artifact of job" in await r.text()


# -- 7. sign-in sends nowhere else -----------------------------------------------------------------


OFF_SITE = (
    "//evil.example/",
    "https://evil.example",
    "http:evil.example",
    "/\\evil.example",
    "\\\\evil.example",
    "/\t/evil.example",  # a browser drops tabs and newlines from a URL: this is //evil.example
    "/\n/evil.example",
    "/\r/evil.example",
    "evil.example",
    "",
)


async def test_sign_in_redirects_only_to_a_path_on_this_server(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    async with running_pool(redis_server, tmp_path) as pool:
        token = pool.tokens["alice"]
        async with client() as http:
            for target in OFF_SITE:
                async with http.post(
                    base(pool) + "/signin",
                    params={"next": target},
                    data={"token": token},
                    allow_redirects=False,
                ) as r:
                    assert r.status == 303, (target, await r.text())
                    assert r.headers["Location"] == "/", target
            # Signed in, the sign-in page sends on at once: to this server only as well.
            for target in OFF_SITE:
                async with http.get(
                    base(pool) + "/signin", params={"next": target}, allow_redirects=False
                ) as r:
                    assert r.status == 303
                    assert r.headers["Location"] == "/", target
            async with http.get(
                base(pool) + "/signin", params={"next": "/jobs?user=bob"}, allow_redirects=False
            ) as r:
                assert r.headers["Location"] == "/jobs?user=bob"


# -- 8. sign-out -----------------------------------------------------------------------------------


async def test_sign_out_ends_the_session_for_good(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    async with running_pool(redis_server, tmp_path) as pool, client() as http:
        url = base(pool)
        csrf = await sign_in(http, pool, "alice")
        session_id = next(c.value for c in http.cookie_jar if c.key == COOKIE)
        async with http.post(url + "/signout", allow_redirects=False) as r:  # no CSRF: another site's form
            assert r.status == 403
        async with http.get(url + "/", allow_redirects=False) as r:
            assert r.status == 200
        async with http.post(url + "/signout", data={"csrf": csrf}, allow_redirects=False) as r:
            assert r.status == 303
            assert r.headers["Location"] == "/signin"
            forget = cookie_attributes(r)  # the browser forgets it
            assert forget["value"] in ("", '""')
            assert forget["max-age"] == "0"
        async with client(cookies={COOKIE: session_id}) as replay:  # one that kept it anyway
            async with replay.get(url + "/", allow_redirects=False) as r:
                assert r.status == 303
                assert r.headers["Location"] == "/signin?next=/"
            async with replay.get(url + "/live/jobs", headers=SSE) as r:
                assert r.status == 401
            async with replay.post(url + "/signout", data={"csrf": csrf}, allow_redirects=False) as r:
                assert r.status == 401


# -- 9. beyond loopback only with tokens -----------------------------------------------------------


async def test_a_dashboard_beyond_loopback_without_tokens_is_refused_at_start(pool: Pool) -> None:
    queue = pool.queue
    handlers = Handlers(queue, JobEvents(queue, 1.0), pool.server.list_workers)
    snapshots = Snapshots(queue, pool.server.list_workers)
    for host in ("0.0.0.0", "::", "192.0.2.7", "pool.lab"):
        with pytest.raises(ListenerError) as refused:
            WebServer(handlers, snapshots, None, host, 0, tls=None, extra_hosts=[])
        assert "tokens_file" in str(refused.value), host
    # On loopback an open dashboard is allowed: whoever is on the machine says who they are.
    server = WebServer(handlers, snapshots, None, "127.0.0.1", 0, tls=None, extra_hosts=[])
    await server.start()
    try:
        async with client() as http, http.get(server.address + "/signin") as r:
            assert r.status == 200
            assert 'name="user"' in await r.text()
    finally:
        await server.stop()
        await server.stop()


# -- 10. the live views ----------------------------------------------------------------------------


async def test_every_pages_live_view_streams_its_block(busy: Busy) -> None:
    """Each page names its live view in data-live; that URL streams the page's live block."""
    pool, job = busy.pool, busy.job_id
    async with client() as alice:
        await sign_in(alice, pool, "alice")
        for path, shows in (
            ("/", 'id="queues"'),
            ("/jobs?user=alice", job),
            (f"/jobs/{job}", job),
            (f"/workers/{busy.worker_id}", busy.worker_id),
        ):
            async with alice.get(base(pool) + path) as r:
                found = re.search(r'data-live="([^"]+)"', await r.text())
            assert found is not None, path
            async with alice.get(base(pool) + found.group(1).replace("&amp;", "&"), headers=SSE) as r:
                assert r.status == 200, (path, found.group(1))
                assert r.content_type == "text/event-stream"
                assert shows in await first_event(r), path


async def test_a_live_job_page_streams_and_each_user_has_a_limit_of_them(
    busy: Busy, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(live_module, "LIVE_PER_USER", 2)
    pool, job = busy.pool, busy.job_id
    live = f"{base(pool)}/live/jobs/{job}"
    async with client() as alice, client() as bob:
        await sign_in(alice, pool, "alice")
        await sign_in(bob, pool, "bob")
        first = await alice.get(live, headers=SSE)
        second = await alice.get(f"{base(pool)}/live/", headers=SSE)
        try:
            assert first.status == 200
            assert second.status == 200
            assert job in await first_event(first)
            async with alice.get(live, headers=SSE) as third:
                assert third.status == 429
                assert "alice already has 2 live pages open" in await third.text()
                assert_guarded(third)
            async with bob.get(live, headers=SSE) as r:  # another user is still served
                assert r.status == 200
                assert job in await first_event(r)
        finally:
            first.close()

        # A closed view gives its place back.
        async def served_again() -> bool:
            async with alice.get(live, headers=SSE) as r:
                return r.status == 200

        try:
            await wait_until(served_again, timeout=5.0, what="a closed live view to give its place back")
        finally:
            second.close()


async def test_live_pages_leave_a_users_blocking_reads_to_wait_and_logs(
    busy: Busy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page's stream polls the shared snapshot and holds no Redis read: open tabs do not take
    the budget of `poolctl wait` and `logs -f`; a log stream, which holds one, does."""
    monkeypatch.setattr(handlers_module, "MAX_BLOCKING_PER_USER", 1)
    pool, job = busy.pool, busy.job_id
    async with client() as alice:
        await sign_in(alice, pool, "alice")
        pages = [await alice.get(f"{base(pool)}/live/jobs/{job}", headers=SSE) for _ in range(3)]
        log = await alice.get(f"{base(pool)}/jobs/{job}/log", headers=SSE)
        try:
            assert [p.status for p in pages] == [200, 200, 200]
            assert log.status == 200
            assert "started" in await first_event(log)  # the job's first line, as an event
            async with alice.get(f"{base(pool)}/jobs/{job}/log", headers=SSE) as second_log:
                assert second_log.status == 429
                assert (
                    "alice already has 1 'logs -f', 'wait' and live views running" in await second_log.text()
                )
        finally:
            for r in (*pages, log):
                r.close()


async def test_a_pool_whose_redis_is_down_says_so_and_answers_again_when_it_is_back(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    async with running_pool(redis_server, tmp_path) as pool, client() as http:
        await sign_in(http, pool, "alice")
        assert pool.server.web is not None
        pool.server.web.snapshots.max_age = 0.0  # every page reads the pool afresh
        redis_server.kill()
        for path in ("/", "/jobs", "/workers/w1"):
            async with http.get(base(pool) + path) as r:
                assert r.status == 503, path
                text = html.unescape(await r.text())
                assert "the pool's Redis is unreachable right now; retry in a moment" in text
        redis_server.start()
        async with asyncio.timeout(20):
            while True:
                async with http.get(base(pool) + "/") as r:
                    if r.status == 200:
                        break
                await asyncio.sleep(0.2)


# -- from a review of the dashboard ------------------------------------------------------------------


async def test_a_carriage_return_in_a_job_name_cannot_end_an_event_early(busy: Busy) -> None:
    pool = busy.pool
    await pool.queue.enqueue(sh("true", user="bob", name="x\revent: forged\r\rdata: <b>injected</b>"))
    async with client() as http:
        await sign_in(http, pool, "alice")
        async with http.get(base(pool) + "/live/jobs?user=bob", headers=SSE) as r:
            raw = b""
            async with asyncio.timeout(5):
                async for chunk in r.content.iter_any():
                    raw += chunk
                    if b"\n\n" in raw:
                        break
    event = raw.split(b"\n\n")[0]
    assert b"\r" not in event  # a lone CR would end the line, and the next field would be the job's
    assert all(line.startswith((b"data:", b":")) for line in event.split(b"\n")), event


async def test_a_live_stream_ends_when_its_session_does(busy: Busy) -> None:
    pool = busy.pool
    async with client() as http:
        csrf = await sign_in(http, pool, "alice")
        async with http.get(base(pool) + "/live/jobs", headers=SSE) as stream:
            await first_event(stream)
            async with http.post(base(pool) + "/signout", data={"csrf": csrf}, allow_redirects=False) as r:
                assert r.status == 303
            async with asyncio.timeout(10):  # the stream sees the session gone at its next turn
                async for _ in stream.content.iter_any():
                    pass
            assert stream.content.at_eof()


async def test_a_form_from_another_port_of_the_same_host_is_refused(busy: Busy) -> None:
    pool = busy.pool
    async with client() as http:
        csrf = await sign_in(http, pool, "alice")
        other = f"http://127.0.0.1:{port(pool) + 1 if port(pool) < 65535 else port(pool) - 1}"
        url = f"{base(pool)}/jobs/{busy.job_id}/cancel"
        async with http.post(url, data={"csrf": csrf}, headers={"Origin": other}, allow_redirects=False) as r:
            assert r.status == 403
        assert await still_running(busy)


async def test_a_connection_that_sends_no_request_is_closed(
    redis_server: EmbeddedRedis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from daemon.server.web import app as web_app

    monkeypatch.setattr(web_app, "IDLE_SECONDS", 0.5)
    async with running_pool(redis_server, tmp_path) as pool:
        reader, writer = await asyncio.open_connection("127.0.0.1", port(pool))
        try:
            async with asyncio.timeout(10):
                assert await reader.read() == b""  # closed by the server, not by this test
        finally:
            writer.close()


def test_the_dashboards_own_certificate_is_not_what_poolctl_pins(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    """A pool whose protocol listens on loopback (no TLS) and whose dashboard listens beyond it
    (TLS, the server's own certificate): poolctl must not be told to expect TLS on the protocol."""
    from daemon.server.service import PoolServer
    from tests.support.pool import pool_config

    server = PoolServer(pool_config(redis_server, tmp_path, ("alice",)))
    assert server._tls("192.0.2.7:7421", protocol=False) is not None
    assert server.own_certificate is None
    assert server._tls("127.0.0.1:7420") is None
    assert server.own_certificate is None
    assert server._tls("192.0.2.7:7420") is not None
    assert server.own_certificate is not None


def test_times_on_the_pages_name_their_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from daemon.server.web.render import when

    monkeypatch.setenv("TZ", "CET-1")  # a POSIX zone: no tzdata needed
    time.tzset()
    try:
        assert when(1_764_864_000.0) == "2025-12-04 17:00:00 CET"  # 16:00 UTC
    finally:
        monkeypatch.undo()
        time.tzset()
