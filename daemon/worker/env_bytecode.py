"""An environment's bytecode, made after it is published: a speed mechanism behind one switch,
EnvSettings.bytecode_later (worker_env_bytecode_later).

A job cannot write .pyc files into its read-only environment, so they are made for it. Made in
the build (uv's UV_COMPILE_BYTECODE), they delay the first job by the compiling of every module
(uv compiles them all; a laptop's first run compiles only those it imports, as it imports them).
Made after, the first jobs compile what they import in memory, as that first run would, and the
rest find them made. They are compiled as the builder into a tree of the build's own (Python's
pycache_prefix: the environment is the worker's, read-only), then, the builder's processes gone,
each is given to the worker and moved into its `__pycache__`.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

from daemon.worker.env_build import Builder

# compileall on every core, but only where a core is idle (SCHED_IDLE, which its workers
# inherit): the first jobs, importing what they need, must not wait for it.
COMPILE_WHEN_IDLE = (
    "import os, runpy, sys; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0)); "
    "sys.argv[1:1] = ['-q', '-j', '0']; "
    "runpy.run_module('compileall', run_name='__main__', alter_sys=True)"
)


async def make_bytecode(uv: Builder, target: Path, work: Path) -> int:
    """Compile the modules of the environment at `target` as the builder, in the build directory
    `work` (made here, removed by the caller), and place them: bytes added to the environment.
    A module that does not compile, as some packages ship, is left out."""
    await asyncio.to_thread(uv.lay_out, work, work / "pyc", None)
    sites = await asyncio.to_thread(lambda: [str(p) for p in target.glob("lib/python*/site-packages")])
    python = [str(target / "bin" / "python"), "-I", "-S", "-X", f"pycache_prefix={work / 'pyc'}"]
    try:
        await uv.run([*python, "-c", COMPILE_WHEN_IDLE, *sites], uv.environment(work), work)
    finally:
        await uv.sweep()
    builder = uv.builder.uid if uv.builder is not None else os.geteuid()
    return await asyncio.to_thread(place_bytecode, work / "pyc", target, builder)


def place_bytecode(made: Path, target: Path, builder: int) -> int:
    """Move the .pyc files `made` holds for `target` into its `__pycache__` directories, the
    worker's and read-only like the rest of it. Only plain files of the builder's with one
    link: a hard link to another file would have its mode changed; `builder` is the uid that
    made them. Bytes moved. Blocking."""
    uid, gid = os.geteuid(), os.getegid()
    mirror = made / target.relative_to(target.anchor)
    added = 0
    for top, _, files in os.walk(mirror):
        source_dir = target / Path(top).relative_to(mirror)
        if not source_dir.is_dir() or source_dir.is_symlink():
            continue
        for name in files:
            path = os.path.join(top, name)
            st = os.lstat(path)
            if not (name.endswith(".pyc") and stat.S_ISREG(st.st_mode)):
                continue
            if st.st_uid != builder or st.st_nlink != 1:
                continue
            cache = source_dir / "__pycache__"
            if not cache.is_dir():
                cache.mkdir()
                cache.chmod(0o755)
            if os.path.lexists(cache / name):
                continue
            os.chown(path, uid, gid)
            os.chmod(path, 0o444)
            os.rename(path, cache / name)
            added += st.st_size
    return added
