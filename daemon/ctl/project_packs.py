"""A project's files as packs: content-addressed objects of ~8 MiB each, so a resubmit sends only
what changed (issue 45 item 1).

The files, in sorted path order, are cut into runs; each run is a deterministic tar
(storage/content.py `pack_entries`) stored as one object under its sha256, as a dataset is
(PrepareUpload, then the bytes unless the pool has them, then FinishUpload), except those the
pool says, in one CheckObjects for them all, the user stored already: an unchanged resubmit is
that one request and the job's. Where a run ends is
decided as content-defined chunking decides it, by the files and not by their place in the list:
once a pack holds MIN_PACK bytes, a file ends it when a hash of its path falls below its size,
rounded up to a power of two, over PACK_BYTES (a pack is ended at MAX_PACK bytes whatever the
hashes). A file rewritten at its size changes its own pack and no other; one that grows or
shrinks, or a file added or removed, may move the next boundary or two, after which the cuts are
the same again. A pack holds some 7 MiB on average, whatever the files; the pack a changed file
is in is somewhat larger, as a larger pack more likely holds it (bench/project_resubmit.py).

The job spec carries the list of the packs' sha256s (daemon/job.py `project`): what a job may
read from the store is in its spec. The worker unpacks them in order into the job's directory
(daemon/worker/job_data.py).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from daemon.client.pool_client import PoolClient
from daemon.ctl.pack_cache import PackCache
from daemon.ctl.project import Project, ProjectFile
from daemon.spec_checks import project_id
from protocol import CheckObjects, ObjectsHeld
from storage.content import pack_entries, stream_sha256

# Past MIN_PACK, a file ends its pack with probability (its size rounded up to a power of two) /
# PACK_BYTES, from 1 to 2 times its size / PACK_BYTES: a pack holds MIN_PACK and some 3 MiB more
# on average. Bounded below, packs vary less, and the pack a changed file is in (a larger pack
# more likely holds it) is not much larger than the mean.
MIN_PACK = 4 * 2**20
PACK_BYTES = 4 * 2**20
MAX_PACK = 16 * 2**20
ASKING_AT_ONCE = 8  # packs asked about (and sent) at once: round trips overlap


Pack = tuple[ProjectFile, ...]


def ends_pack(f: ProjectFile, held: int) -> bool:
    """Whether `f` is the last file of a pack that holds `held` bytes with it."""
    if held < MIN_PACK:
        return False
    if held >= MAX_PACK:
        return True
    weight = 1 << max(f.size, 1).bit_length()
    draw = int.from_bytes(hashlib.blake2b(f.name.encode(), digest_size=8).digest(), "big")
    return draw < 2**64 * weight // PACK_BYTES


def cut(files: Sequence[ProjectFile]) -> list[Pack]:
    """The files (sorted by name) in runs, each ending at a file that `ends_pack`."""
    packs: list[Pack] = []
    run: list[ProjectFile] = []
    held = 0
    for f in files:
        run.append(f)
        held += f.size
        if ends_pack(f, held):
            packs.append(tuple(run))
            run, held = [], 0
    if run:
        packs.append(tuple(run))
    return packs


def entries(pack: Pack) -> list[tuple[str, str]]:
    return [(f.name, f.path) for f in pack]


def hash_pack(pack: Pack) -> tuple[str, int]:
    """(sha256, size) of the pack's tar, read from its files (blocking)."""
    return stream_sha256(pack_entries(entries(pack)))


@dataclass(frozen=True, slots=True)
class Sent:
    """What a project's upload did: its spec entry, and what it sent."""

    spec: dict[str, Any]
    packs: int
    packs_sent: int
    bytes_sent: int


async def describe(project: Project, cache: PackCache) -> list[tuple[Pack, str, int]]:
    """Each pack with its (sha256, size): from `cache` where none of its files changed, else read."""

    def hashed() -> list[tuple[Pack, str, int]]:
        out = []
        for pack in cut(project.files):
            known = cache.get(pack)
            if known is None:
                known = hash_pack(pack)
                cache.put(pack, *known)
            out.append((pack, *known))
        return out

    return await asyncio.to_thread(hashed)


async def upload(client: PoolClient, project: Project, cache: PackCache) -> Sent:
    """Store the project's packs the pool lacks; the job spec's `project` entry."""
    from daemon.ctl import transfer  # aiohttp: only where data moves

    described = await describe(project, cache)
    packs = [sha for _, sha, _ in described]
    held = set((await client.call(CheckObjects(packs), ObjectsHeld)).sha256s)
    limit = asyncio.Semaphore(ASKING_AT_ONCE)

    async def one(pack: Pack, sha: str, size: int) -> bool:
        if sha in held:
            return False
        async with limit:
            source = transfer.Source("dir", project.root, sha, size, entries=tuple(entries(pack)))
            _, sent = await transfer.upload(client, source, None, f"project pack {sha[:12]}")
            return sent

    sent = await asyncio.gather(*(one(*d) for d in described))
    cache.save()
    spec = {
        "id": project_id(packs),
        "packs": packs,
        "dir": project.dir,
        "commit": project.commit,
        "dirty": project.dirty,
        "files": len(project.files),
        "size": project.size,
    }
    bytes_sent = sum(size for (_, _, size), was in zip(described, sent, strict=True) if was)
    return Sent(spec, len(packs), sum(sent), bytes_sent)
