"""The web dashboard: the pool, its jobs and workers as pages, served by poold in server mode.

A view of what the wire protocol already serves: every read and every change goes through the
server's `Handlers` with the signed-in user, so the dashboard authorises exactly as poolctl does.
Pages are rendered on the server (Jinja2); one small script keeps them live over server-sent
events. What guards them (sign-in, cookies, CSRF, the Host header, the Content-Security-Policy)
is guard.py; docs/SECURITY.md says why each.
"""
