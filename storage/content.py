"""Content addressing: sha256 of files and directory trees, deterministic tar packing, safe unpacking.

A dataset directory or a code snapshot becomes one object: a tar stream whose bytes depend only on
the tree's paths, file contents, symlink targets and executable bits. Entries are sorted, and
mtimes, owners and permission noise are fixed, so the same tree always gives the same sha256 — the
key it is stored under — and an unchanged dataset is never uploaded twice.

The tar is written by hand (header from `TarInfo.tobuf`, then the data in chunks, then padding)
instead of through `tarfile.addfile`, because `addfile` copies a whole member in one go and the
stream must stay bounded in memory whatever the file sizes.

Unpacking refuses anything that could write outside the destination: absolute names, `..`,
symlinks or hard links pointing outside, device files. The stdlib's "data" filter then checks the
same again at extraction time (it also resolves symlinks already on disk).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import posixpath
import stat
import tarfile
from collections.abc import AsyncIterator, Generator, Iterable, Iterator
from pathlib import Path

from storage.base import StorageError

log = logging.getLogger(__name__)

CHUNK = 1024 * 1024
_BLOCK = tarfile.BLOCKSIZE


class UnsafeArchive(StorageError):
    code = "unsafe_archive"

    def __init__(self, member: str, reason: str) -> None:
        super().__init__(f"refusing to unpack member {member!r}: {reason}")
        self.member = member


def content_key(sha256: str, prefix: str = "sha256") -> str:
    """The store key of a content-addressed object; two hex digits fan out S3 listings and dirs."""
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise StorageError(f"{sha256!r} is not a lowercase hex sha256")
    return f"{prefix}/{sha256[:2]}/{sha256}"


def sha256_file(path: Path) -> str:
    """sha256 of a file, read in 1 MiB chunks (blocking: call via asyncio.to_thread)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _walk(root: Path) -> Iterator[Path]:
    """Every entry under root (not root itself), deterministically ordered, without following links.

    A directory's entries are sorted by name and listed before what is inside its subdirectories;
    symlinks to directories appear in `dirnames` but os.walk does not descend into them.
    """
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()  # in place: os.walk then descends in this order
        for name in sorted(dirnames + filenames):
            yield Path(dirpath) / name


def _info(path: str | Path, name: str) -> tarfile.TarInfo | None:
    st = os.lstat(path)
    info = tarfile.TarInfo(name)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    # Only the executable bit survives: umask differences between machines must not change a hash.
    if stat.S_ISDIR(st.st_mode):
        info.type, info.mode = tarfile.DIRTYPE, 0o755
    elif stat.S_ISLNK(st.st_mode):
        info.type, info.mode = tarfile.SYMTYPE, 0o777
        info.linkname = os.readlink(path)
    elif stat.S_ISREG(st.st_mode):
        info.type, info.size = tarfile.REGTYPE, st.st_size
        info.mode = 0o755 if st.st_mode & 0o100 else 0o644
    else:
        log.warning("skipping %s: not a file, directory or symlink", path)
        return None
    return info


def pack_tree(root: Path) -> Generator[bytes, None, None]:
    """Yield a deterministic tar stream of the tree under `root` in chunks of at most ~1 MiB.

    Blocking (reads files): iterate it in a thread, or use `pack_tree_async`.
    """
    root = Path(root)
    if not root.is_dir():
        raise StorageError(f"{root} is not a directory")
    return _pack(root, _walk(root))


def pack_files(root: Path, names: Iterable[str]) -> Generator[bytes, None, None]:
    """Like `pack_tree`, but only the files and symlinks `names` (relative POSIX paths under
    `root`, e.g. what `git ls-files` lists), in sorted order. Names that are missing or are
    directories are skipped. Blocking."""
    root = Path(root)
    paths = []
    for name in sorted(set(names)):
        path = root / name
        if path.is_symlink() or path.is_file():
            paths.append(path)
    return _pack(root, iter(paths))


def _pack(root: Path, paths: Iterator[Path]) -> Generator[bytes, None, None]:
    return pack_entries((path.relative_to(root).as_posix(), path) for path in paths)


def pack_entries(entries: Iterable[tuple[str, str | Path]]) -> Generator[bytes, None, None]:
    """A deterministic tar of `entries`, each (its name in the tar, the file or symlink to read),
    in the order given (a project's pack, daemon/ctl/project_packs.py: some of its files, one of
    which may be a lock written elsewhere). Blocking."""
    for name, path in entries:
        info = _info(path, name)
        if info is None:
            continue
        yield info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
        if info.type != tarfile.REGTYPE:
            continue
        remaining = info.size
        with open(path, "rb") as f:
            while remaining > 0:
                chunk = f.read(min(CHUNK, remaining))
                if not chunk:
                    raise StorageError(f"{path} shrank while it was being packed")
                remaining -= len(chunk)
                yield chunk
        if info.size % _BLOCK:
            yield b"\0" * (_BLOCK - info.size % _BLOCK)
    yield b"\0" * (2 * _BLOCK)  # end-of-archive marker


async def pack_tree_async(root: Path) -> AsyncIterator[bytes]:
    """`pack_tree` with the file reads in a worker thread, for `ObjectStore.put_stream`."""
    async for chunk in iterate_in_thread(pack_tree(root)):
        yield chunk


async def iterate_in_thread(gen: Generator[bytes, None, None]) -> AsyncIterator[bytes]:
    """Drive a blocking chunk generator (`pack_tree`, `pack_files`) from a worker thread."""
    done = object()
    try:
        while (chunk := await asyncio.to_thread(next, gen, done)) is not done:
            assert isinstance(chunk, bytes)
            yield chunk
    finally:
        gen.close()


def tree_sha256(root: Path) -> tuple[str, int]:
    """(sha256, size) of the packed tree: its content address, without storing the tar."""
    return stream_sha256(pack_tree(root))


def stream_sha256(chunks: Iterable[bytes]) -> tuple[str, int]:
    """(sha256, size) of a chunk stream (blocking)."""
    h = hashlib.sha256()
    size = 0
    for chunk in chunks:
        h.update(chunk)
        size += len(chunk)
    return h.hexdigest(), size


def _inside(dest: str, target: str) -> bool:
    return target == dest or target.startswith(dest + os.sep)


def check_member(member: tarfile.TarInfo, dest: Path) -> None:
    """Raise UnsafeArchive unless extracting `member` stays inside `dest`."""
    name = member.name
    if name.startswith("/") or posixpath.isabs(name) or (len(name) > 1 and name[1] == ":"):
        raise UnsafeArchive(name, "absolute path")
    if ".." in name.split("/") or "\\" in name:
        raise UnsafeArchive(name, "path leaves the destination ('..' or backslash)")
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        raise UnsafeArchive(name, "device, fifo or other special file")
    root = os.path.realpath(dest)
    if not _inside(root, os.path.normpath(os.path.join(root, name))):
        raise UnsafeArchive(name, "path leaves the destination")
    if member.issym():
        target = member.linkname
        if posixpath.isabs(target):
            raise UnsafeArchive(name, f"symlink to absolute path {target!r}")
        resolved = os.path.normpath(os.path.join(root, posixpath.dirname(name), target))
        if not _inside(root, resolved):
            raise UnsafeArchive(name, f"symlink {target!r} points outside the destination")
    if member.islnk():
        resolved = os.path.normpath(os.path.join(root, member.linkname))
        if posixpath.isabs(member.linkname) or not _inside(root, resolved):
            raise UnsafeArchive(name, f"hard link to {member.linkname!r} outside the destination")


def unpack_tar(archive: Path, dest: Path) -> None:
    """Extract `archive` into `dest` (created if needed), refusing unsafe members before writing
    anything. Blocking: call via asyncio.to_thread."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:") as tar:
        members = tar.getmembers()
        for member in members:
            check_member(member, dest)
        try:
            tar.extractall(dest, members=members, filter="data")
        except tarfile.FilterError as e:
            # Our checks are lexical; the data filter also sees symlinks already on disk.
            raise UnsafeArchive(getattr(e.tarinfo, "name", "?"), str(e)) from e
