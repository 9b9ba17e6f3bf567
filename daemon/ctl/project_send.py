"""A job's project sent to the pool: found, checked, locked, its packs uploaded where the pool lacks
them; the spec's `project` entry is what comes back. poolctl's enqueue and the Python API
(gpupool/) both send one so, and a job from either runs in the same copy of the same project."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from daemon.client.pool_client import PoolClient
from daemon.client.session import AuthFailed, ClientError, ServerUnreachable
from daemon.ctl.parsing import UsageError


async def send(client: PoolClient, start: Path, *, named: bool, required: bool) -> dict[str, Any] | None:
    """The spec's `project` for the project `start` is in (`named`: `start` itself as one, where it
    is in none; `start` as `project_root.real` gives it), or None outside any project; UsageError
    there when `required` (--snapshot), or when the project cannot be listed or sent."""
    from daemon.ctl import project, project_packs
    from daemon.ctl.pack_cache import PackCache, cache_dir
    from daemon.ctl.project_root import MARKERS, real
    from daemon.ctl.transfer import TransferError
    from daemon.git import GitError

    try:
        home = real(Path.home())
        found = await (project.named if named else project.find)(start, home)
    except GitError as exc:
        raise UsageError(f"cannot list the project's files: {exc}") from None
    if found is None:
        if required:
            raise UsageError(
                "--snapshot needs a project here: a git working tree, or a directory holding "
                f"{', '.join(MARKERS)}"
            )
        return None
    project.check_size(found, project.max_bytes())
    pyproject = await asyncio.to_thread(project.needs_lock, found)
    lock = pyproject and await asyncio.to_thread(project.lock_for, pyproject, cache_dir())
    if lock:
        found = project.with_lock(found, lock)
    try:
        sent = await project_packs.upload(client, found, PackCache(found.root))
    except TransferError as exc:
        raise UsageError(str(exc)) from None
    except ClientError as exc:  # the pool's store, mostly: the way round it is said
        if isinstance(exc, ServerUnreachable | AuthFailed):
            raise
        hint = f"{exc.message}; the job was not queued (--workdir none runs it without {found.root})"
        raise ClientError(hint, exc.code) from None
    return sent.spec
