"""The environment of the helper processes the daemon starts (the worker's orphan guard, the
embedded redis-server): what finds programs, and nothing else of the daemon's own.

The daemon's environment may hold its secrets (GPUPOOL_*_PASSWORD, S3 keys: a systemd unit's
environment file, a pilot's batch script). The worker makes itself non-dumpable so that no process
of its uid reads them out of /proc, but a program it starts is dumpable again once exec'd, and its
/proc/PID/environ is then open to every process of the same uid: on a worker that runs jobs as its
own user (a pilot, a user's own pool), to every job. Its argv is open to every uid. So a helper is
given its secrets, if any, in a file its uid alone may read (redis.conf), never in either.
"""

from __future__ import annotations

import os


def helper_env() -> dict[str, str]:
    """The whole environment of a helper process: PATH, as the daemon has it."""
    return {"PATH": os.environ.get("PATH", os.defpath)}
