"""A project's packs (issue 45 item 1): where they are cut, and what the hash cache may skip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from daemon.ctl import project_packs
from daemon.ctl.pack_cache import SWITCH, PackCache
from daemon.ctl.project import Project, ProjectFile
from storage.content import pack_entries, unpack_tar


def listed(root: Path) -> Project:
    files = []
    for path in sorted(root.rglob("*")):
        if path.is_file():
            st = path.lstat()
            name = path.relative_to(root).as_posix()
            files.append(ProjectFile(name, str(path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_mode))
    return Project(root, "", tuple(files), "", True)


def aged(path: Path) -> None:
    """Its mtime an hour back: a file no longer racily clean (pack_cache.RACY_SECONDS)."""
    then = path.stat().st_mtime - 3600
    os.utime(path, (then, then))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "proj"
    for i in range(400):
        path = root / f"d{i % 7}" / f"f{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(100_000))
        aged(path)
    return root


def shas(project: Project, cache: PackCache) -> list[str]:
    return [sha for _, sha, _ in _described(project, cache)]


def _described(project: Project, cache: PackCache) -> list[tuple[project_packs.Pack, str, int]]:
    out = []
    for pack in project_packs.cut(project.files):
        known = cache.get(pack)
        if known is None:
            known = project_packs.hash_pack(pack)
            cache.put(pack, *known)
        out.append((pack, *known))
    return out


def test_one_changed_file_changes_its_own_pack_only(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 45 item 1: pack boundaries depend on each file alone, so a file rewritten (in the same
    size class) changes one pack's sha256, and the packs unpack to the tree."""
    monkeypatch.setenv(SWITCH, "off")
    before = shas(listed(tree), PackCache(tree, tmp_path / "c"))
    (tree / "d3" / "f101.bin").write_bytes(os.urandom(100_000))
    after = shas(listed(tree), PackCache(tree, tmp_path / "c"))
    monkeypatch.delenv(SWITCH)
    assert 3 < len(before) == len(after)
    assert sum(a != b for a, b in zip(before, after, strict=True)) == 1

    out = tmp_path / "out"
    for pack, _, _ in _described(listed(tree), PackCache(tree, tmp_path / "c")):
        tar = tmp_path / "pack.tar"
        with open(tar, "wb") as f:
            for chunk in pack_entries(project_packs.entries(pack)):
                f.write(chunk)
        unpack_tar(tar, out)
    assert (out / "d3" / "f101.bin").read_bytes() == (tree / "d3" / "f101.bin").read_bytes()
    assert len(list(out.rglob("*.bin"))) == 400


def test_the_hash_cache_gives_what_reading_gives_and_sees_a_change(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 45 item 1 (STYLE §20: the plain path is the truth): the cache's sha256s are those the
    files give read again, with no file read; a file changed since (its stat with it) is read
    again; a pack with a file changed within RACY_SECONDS is never kept."""
    cache_dir = tmp_path / "c"
    first = PackCache(tree, cache_dir)
    truth = shas(listed(tree), first)
    first.save()
    again = PackCache(tree, cache_dir)
    assert shas(listed(tree), again) == truth
    assert again.hits == len(truth)

    path = tree / "d0" / "f007.bin"
    path.write_bytes(os.urandom(100_000))  # changed, and too recently to be kept
    cached = PackCache(tree, cache_dir)
    now = shas(listed(tree), cached)
    cached.save()
    assert cached.hits == len(truth) - 1
    monkeypatch.setenv(SWITCH, "off")
    assert now == shas(listed(tree), PackCache(tree, cache_dir)) != truth
    monkeypatch.delenv(SWITCH)
    [racy] = [p for p in project_packs.cut(listed(tree).files) if any(f.path == str(path) for f in p)]
    assert PackCache(tree, cache_dir).get(racy) is None
