"""Directory datasets: deterministic packing, round trip through the store, unsafe archives refused."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from storage.base import StorageError
from storage.content import (
    UnsafeArchive,
    content_key,
    pack_tree,
    pack_tree_async,
    sha256_file,
    tree_sha256,
    unpack_tar,
)
from tests.storage.conftest import PART, Backend


def make_tree(root: Path) -> None:
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "a.txt").write_text("alpha\n")
    (root / "sub" / "b.bin").write_bytes(os.urandom(1000))
    (root / "sub" / "deeper" / "big").write_bytes(b"\x01" * (PART + 3))
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "link").symlink_to("sub/b.bin")
    (root / ("n" * 120)).write_text("a name too long for plain ustar\n")


def snapshot(root: Path) -> dict[str, tuple[str, bytes | str, bool]]:
    """Everything packing promises to keep: paths, contents, link targets, executable bits."""
    out: dict[str, tuple[str, bytes | str, bool]] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = ("link", os.readlink(path), False)
        elif path.is_dir():
            out[rel] = ("dir", b"", False)
        else:
            out[rel] = ("file", path.read_bytes(), bool(path.stat().st_mode & 0o100))
    return out


def test_same_tree_same_hash(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    make_tree(a)
    make_tree(b)
    (b / "sub" / "b.bin").write_bytes((a / "sub" / "b.bin").read_bytes())
    os.utime(b / "a.txt", (1, 1))  # mtimes and permission noise do not change the hash
    (b / "a.txt").chmod(0o600)
    assert tree_sha256(a) == tree_sha256(b)
    (b / "a.txt").write_text("changed\n")
    assert tree_sha256(a) != tree_sha256(b)


def test_content_key_validates() -> None:
    sha = "ab" * 32
    assert content_key(sha) == f"sha256/ab/{sha}"
    with pytest.raises(StorageError, match="sha256"):
        content_key("../etc/passwd")


async def test_directory_dataset_round_trip(backend: Backend, tmp_path: Path) -> None:
    src = tmp_path / "dataset"
    make_tree(src)
    sha, size = tree_sha256(src)
    key = content_key(sha)
    info = await backend.store.put_stream(key, pack_tree_async(src), sha256=sha, if_absent=True)
    assert (info.sha256, info.size) == (sha, size)
    assert await backend.store.exists(key)  # the caller's skip-if-present check
    archive = tmp_path / "dl.tar"
    await backend.store.get_file(key, archive)
    assert sha256_file(archive) == sha
    unpack_tar(archive, tmp_path / "out")
    assert snapshot(tmp_path / "out") == snapshot(src)


def tar_with(*members: tuple[tarfile.TarInfo, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for info, data in members:
            info.size = len(data) if info.isfile() else 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    return info


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (member("/etc/evil"), "absolute"),
        (member("../evil"), "leaves"),
        (member("a/../../evil"), "leaves"),
        (member("ln", tarfile.SYMTYPE, "/etc/passwd"), "absolute"),
        (member("ln", tarfile.SYMTYPE, "../../outside"), "outside"),
        (member("hard", tarfile.LNKTYPE, "../outside"), "outside"),
        (member("dev", tarfile.CHRTYPE), "special"),
        (member("fifo", tarfile.FIFOTYPE), "special"),
    ],
    ids=["absolute", "dotdot", "nested-dotdot", "abs-symlink", "escaping-symlink", "hardlink", "dev", "fifo"],
)
def test_unsafe_members_refused(tmp_path: Path, bad: tarfile.TarInfo, why: str) -> None:
    archive = tmp_path / "bad.tar"
    archive.write_bytes(tar_with((member("fine.txt"), b"ok"), (bad, b"x")))
    dest = tmp_path / "dest"
    with pytest.raises(UnsafeArchive, match=why) as err:
        unpack_tar(archive, dest)
    assert err.value.code == "unsafe_archive"
    assert list(dest.iterdir()) == []  # refused before anything was written
    assert not (tmp_path / "evil").exists()


def test_pack_is_a_standard_tar(tmp_path: Path) -> None:
    make_tree(tmp_path / "t")
    data = b"".join(pack_tree(tmp_path / "t"))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = tar.getmembers()
    assert all(m.mtime == 0 and m.uid == 0 and m.uname == "" for m in members)
    names = [m.name for m in members]
    # A directory comes before what it holds, siblings by name.
    assert names[:4] == ["a.txt", "empty", "link", "n" * 120]
    assert names.index("sub") < names.index("sub/b.bin") < names.index("sub/deeper/big")
    modes = {m.name: m.mode for m in members}
    assert (modes["run.sh"], modes["a.txt"], modes["sub"]) == (0o755, 0o644, 0o755)
