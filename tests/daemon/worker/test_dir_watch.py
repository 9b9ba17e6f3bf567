"""dir_watch.py: the kernel's word on which slot directories anything changed since they were made new."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from inotify_simple import Event, flags

from daemon.worker import dir_watch
from daemon.worker.dir_watch import DirWatch


@pytest.fixture
def watch() -> Iterator[DirWatch]:
    w = DirWatch()
    yield w
    w.close()


def made(watch: DirWatch, path: Path) -> Path:
    path.mkdir(mode=0o700)
    watch.made_new(path)
    assert watch.untouched(path)
    return path


@pytest.mark.parametrize(
    "change",
    [
        "touch {d}/f",  # an entry made
        "mkdir {d}/sub",
        "ln -s /etc {d}/link",
        "touch {d}/f; rm {d}/f",  # made and gone again: still looked at
        "chmod 777 {d}",  # its mode
        "chown 1:1 {d}",  # its owner
        "mv {d} {d}.away; mkdir {d}",  # moved away, another in its place
        "rmdir {d}; ln -s /tmp {d}",  # removed, a symlink in its place
    ],
)
def test_any_change_to_a_directory_made_new_is_seen(watch: DirWatch, tmp_path: Path, change: str) -> None:
    d = made(watch, tmp_path / "work")
    other = made(watch, tmp_path / "out")
    subprocess.run(["sh", "-c", change.format(d=d)], check=True)  # another process, as a job is
    assert not watch.untouched(d)
    assert watch.untouched(other)  # only the one changed
    assert not watch.untouched(other, d)  # several: all of them untouched


def test_a_directory_made_new_again_is_untouched_again(watch: DirWatch, tmp_path: Path) -> None:
    d = made(watch, tmp_path / "work")
    (d / "f").touch()
    assert not watch.untouched(d)
    (d / "f").unlink()
    os.chmod(d, 0o700)  # the caller's own reset: its changes are not counted
    watch.made_new(d)
    assert watch.untouched(d)
    d.rmdir()  # and one made anew after its removal is watched anew
    assert not watch.untouched(d)
    d.mkdir()
    watch.made_new(d)
    assert watch.untouched(d)
    (d / "g").touch()
    assert not watch.untouched(d)


def test_a_directory_never_made_new_is_never_untouched(watch: DirWatch, tmp_path: Path) -> None:
    assert not watch.untouched(tmp_path)


def test_lost_events_make_every_directory_count_as_changed(
    watch: DirWatch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full queue loses events (IN_Q_OVERFLOW): no directory can be trusted then. (A real
    overflow needs a machine-wide limit lowered; the kernel's event is handed in instead.)"""
    a, b = made(watch, tmp_path / "a"), made(watch, tmp_path / "b")
    assert watch._inotify is not None
    monkeypatch.setattr(watch._inotify, "read", lambda timeout: [Event(-1, flags.Q_OVERFLOW, 0, "")])
    assert not watch.untouched(a)
    assert not watch.untouched(b)


def test_without_inotify_every_directory_is_looked_at(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(**_: object) -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(dir_watch, "INotify", refused)
    watch = DirWatch()
    d = tmp_path / "work"
    d.mkdir()
    watch.made_new(d)
    assert not watch.untouched(d)
    watch.close()
