"""What poolctl remembers of a project's packs, so that an unchanged resubmit reads no file.

A speed mechanism only (STYLE §20), fenced here behind one switch: GPUPOOL_PACK_CACHE=off makes
every pack be read and hashed again, which gives the same sha256s, only slower. A pack's sha256 is
kept under the stat of its files: for each, its name, size, mtime in nanoseconds, inode and mode
(git's index trusts the same). A pack holding a file changed in the last RACY_SECONDS is not kept:
a write within the clock's granularity after the stat could leave the stat as it was (git's
"racily clean" entries).

One file per project root under poolctl's cache directory ($XDG_CACHE_HOME/gpupool/packs/), JSON,
rewritten after each submit with that submit's packs only, so it never grows past one project's
packs. A file that cannot be read is an empty cache; one that cannot be written is said nowhere
(the next submit reads the files again).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import orjson

from daemon.ctl.project import ProjectFile

SWITCH = "GPUPOOL_PACK_CACHE"
RACY_SECONDS = 2.0


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """poolctl's cache directory: $XDG_CACHE_HOME/gpupool, else ~/.cache/gpupool."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(base) / "gpupool"


def members_key(pack: Sequence[ProjectFile]) -> str:
    """What identifies a pack's files as they are on disk now (their names and stats)."""
    h = hashlib.sha256()
    for f in pack:
        h.update(f"{f.name}\0{f.size}\0{f.mtime_ns}\0{f.inode}\0{f.mode}\n".encode())
    return h.hexdigest()


class PackCache:
    """The packs of one project root: members_key -> (sha256, size)."""

    def __init__(self, root: Path, directory: Path | None = None) -> None:
        self.enabled = os.environ.get(SWITCH, "on").lower() not in ("off", "0", "no", "false")
        name = hashlib.sha256(str(root).encode()).hexdigest()[:32]
        self.path = (directory or cache_dir()) / "packs" / f"{name}.json"
        self.hits = 0  # packs whose sha256 came from here, no file read
        self._known: dict[str, list[object]] = {}
        self._now: dict[str, list[object]] = {}
        if self.enabled:
            with contextlib.suppress(OSError, orjson.JSONDecodeError):
                loaded = orjson.loads(self.path.read_bytes())
                self._known = loaded if isinstance(loaded, dict) else {}

    def get(self, pack: Sequence[ProjectFile]) -> tuple[str, int] | None:
        """The pack's (sha256, size) as last hashed, if none of its files changed since."""
        if not self.enabled:
            return None
        key = members_key(pack)
        entry = self._known.get(key)
        if not (isinstance(entry, list) and len(entry) == 2):
            return None
        sha, size = entry
        if not isinstance(sha, str) or not isinstance(size, int):
            return None
        self._now[key] = entry
        self.hits += 1
        return sha, size

    def put(self, pack: Sequence[ProjectFile], sha256: str, size: int) -> None:
        if not self.enabled:
            return
        newest = max((f.mtime_ns for f in pack), default=0)
        if newest > (time.time() - RACY_SECONDS) * 1e9:
            return  # racily clean: a write now might not change the stat
        self._now[members_key(pack)] = [sha256, size]

    def save(self) -> None:
        """Keep this submit's packs (and only them) for the next."""
        if not self.enabled or self._now == self._known:
            return
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_suffix(f".{os.getpid()}.part")
            partial.write_bytes(orjson.dumps(self._now))
            os.replace(partial, self.path)
