"""The project a job runs in by default, its files listed (issue 45 item 1).

Where it is: daemon/ctl/project_root.py (a git working tree's top, else the nearest directory up
with a marker, below the home and the root). Its files are git's
(`git ls-files -co --exclude-standard`: tracked, and untracked but not ignored), or for a
directory outside git every file; in both cases less what `.poolignore` at the top lists
(gitignore syntax) and never `.git/`. The job starts in the same place inside the copy as
poolctl ran in inside the project.

A symlink leading out of the project is left out (the worker would refuse the whole copy for it,
docs/SECURITY.md), and so are sockets and other special files; a project larger than
`project_max_bytes` is refused before anything is read, naming what is big. The project's
environment lock (daemon/worker/envs.py builds it) goes with it as one of its files; a bare
pyproject.toml is locked here first (`lock_for`).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from daemon.ctl.project_root import marked_root
from daemon.errors import GpupoolError, ProjectTooLarge
from daemon.git import GitError, git
from protocol import ErrorCode

POOLIGNORE = ".poolignore"
# Lock files an environment is built from as they are (a requirements.txt only if it pins hashes).
LOCKS = ("uv.lock", "pylock.toml")
DEFAULT_MAX_BYTES = 512 * 2**20  # the server's project_max_bytes default says the same
MAX_BYTES_ENV = "GPUPOOL_PROJECT_MAX_BYTES"
UV_LOCK_SECONDS = 120.0


class ProjectError(GpupoolError):
    """The project cannot be read as poolctl's settings say."""

    code = ErrorCode.INVALID_ARGUMENT


@dataclass(frozen=True, slots=True)
class ProjectFile:
    """One file of a project: its name in the copy, where its bytes are, and its stat."""

    name: str  # a relative POSIX path inside the project
    path: str  # where it is read from (a lock poolctl made lives outside the project)
    size: int
    mtime_ns: int
    inode: int
    mode: int


@dataclass(frozen=True, slots=True)
class Project:
    root: Path
    dir: str  # where the job starts, relative to `root` ("" for the top)
    files: tuple[ProjectFile, ...]  # sorted by name
    commit: str  # HEAD's commit in a git project ("" outside git, or before the first commit)
    dirty: bool  # the files differ from `commit` (always true outside git)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


async def find(start: Path, home: Path) -> Project | None:
    """The project `start` is in, listed, or None outside any (both paths `project_root.real`)."""
    top = await _git_top(start)
    if top is not None and top not in (home, Path("/")):
        return await _git_project(top, start)
    root = await asyncio.to_thread(marked_root, start, home)
    return None if root is None else await asyncio.to_thread(_plain_project, root, start)


async def named(directory: Path, home: Path) -> Project:
    """`--workdir DIR`: DIR's project, or DIR itself as one where it is in none (both paths
    `project_root.real`)."""
    found = await find(directory, home)
    return found if found is not None else await asyncio.to_thread(_plain_project, directory, directory)


async def _git_top(start: Path) -> Path | None:
    try:  # git says the top as the kernel does, with no symlink in it
        return Path(await git("rev-parse", "--show-toplevel", cwd=start))
    except (GitError, FileNotFoundError):  # not in a work tree, or no git here at all
        return None


async def _git_project(top: Path, start: Path) -> Project:
    async def head() -> str:
        try:
            return await git("rev-parse", "--verify", "-q", "HEAD", cwd=top)
        except GitError:
            return ""  # no commit yet: every file is untracked

    # three git processes at once: a large tree's listing and status take most of a resubmit
    commit, listed, status = await asyncio.gather(
        head(),
        git("ls-files", "-co", "--exclude-standard", "-z", cwd=top, strip=False),
        git("status", "--porcelain", cwd=top),
    )
    names = [n for n in dict.fromkeys(listed.split("\0")) if n]
    files = await asyncio.to_thread(lambda: _stat_all(top, _ignored(top, names)))
    return Project(top, _relative(start, top), files, commit, bool(status))


def _plain_project(root: Path, start: Path) -> Project:
    names: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if here == "." else here + "/"
        dirnames[:] = [d for d in dirnames if d != ".git"]
        names += [prefix + name for name in filenames]
        names += [prefix + name for name in dirnames if os.path.islink(os.path.join(dirpath, name))]
    return Project(root, _relative(start, root), _stat_all(root, _ignored(root, names)), "", True)


def _relative(start: Path, root: Path) -> str:
    here = start.relative_to(root).as_posix()
    return "" if here == "." else here


def _ignored(root: Path, names: list[str]) -> list[str]:
    """`names` less what `.poolignore` lists, and less anything under a `.git` directory."""
    names = [n for n in names if ".git" not in n.split("/")]
    try:
        lines = (root / POOLIGNORE).read_text().splitlines()
    except FileNotFoundError:
        return names
    import pathspec  # only for a project that has a .poolignore

    spec = pathspec.GitIgnoreSpec.from_lines(lines)
    return [n for n in names if not spec.match_file(n)]


def _stat_all(root: Path, names: list[str]) -> tuple[ProjectFile, ...]:
    """Each name's file, sorted; those that are gone, directories (a submodule), special files
    or symlinks out of the project are left out (the last said on stderr). Through os, not
    pathlib: no Path object made for each of a large project's many files."""
    files, outward = [], []
    top = str(root) + "/"
    for name in sorted(names):
        path = top + name
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):  # deleted, but still in git's index
            continue
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(path)
            inside = os.path.normpath(os.path.join(os.path.dirname(name), target))
            if os.path.isabs(target) or inside == ".." or inside.startswith("../"):
                outward.append(name)
                continue
        elif not stat.S_ISREG(st.st_mode):
            continue
        files.append(ProjectFile(name, path, st.st_size, st.st_mtime_ns, st.st_ino, st.st_mode))
    if outward:
        print(
            f"poolctl: left out {len(outward)} symlink(s) that point outside the project, e.g. "
            f"{outward[0]} (list them in {POOLIGNORE} to say nothing)",
            file=sys.stderr,
        )
    return tuple(files)


# -- the size limit --------------------------------------------------------------------------------


def max_bytes() -> int:
    """The largest project poolctl sends: GPUPOOL_PROJECT_MAX_BYTES, else DEFAULT_MAX_BYTES (the
    server refuses above its own project_max_bytes too)."""
    text = os.environ.get(MAX_BYTES_ENV, "")
    try:
        return int(text) if text else DEFAULT_MAX_BYTES
    except ValueError:
        raise ProjectError(f"{MAX_BYTES_ENV}={text!r} is not a number of bytes") from None


def check_size(project: Project, most: int) -> None:
    """ProjectTooLarge naming the biggest directories and files, if the project is over `most`."""
    if project.size <= most:
        return
    by_top: Counter[str] = Counter()
    for f in project.files:
        head, sep, _ = f.name.partition("/")
        if sep:
            by_top[head + "/"] += f.size
    largest = sorted(project.files, key=lambda f: -f.size)[:3]
    biggest = [*by_top.most_common(3), *((f.name, f.size) for f in largest)]
    named = ", ".join(f"{name} ({size / 2**20:.1f} MiB)" for name, size in biggest)
    raise ProjectTooLarge(project.size, most, f"; the biggest: {named}")


# -- the environment's lock ------------------------------------------------------------------------


def has_lock(project: Project) -> bool:
    """Whether a lock goes with the project already: uv.lock, pylock.toml, or a requirements.txt
    that pins every package by hash (pip's --require-hashes form), at its top."""
    names = {f.name: f for f in project.files}
    if any(lock in names for lock in LOCKS):
        return True
    requirements = names.get("requirements.txt")
    return requirements is not None and "--hash=" in Path(requirements.path).read_text(errors="replace")


def needs_lock(project: Project) -> Path | None:
    """The project's pyproject.toml where it declares a project (a [project] table) and no lock
    goes with it: the environment comes from the lock `lock_for` makes."""
    pyproject = next((Path(f.path) for f in project.files if f.name == "pyproject.toml"), None)
    if pyproject is None or has_lock(project):
        return None
    try:
        declared = "project" in tomllib.loads(pyproject.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError):
        return None  # not ours to judge: the files go as they are
    return pyproject if declared else None


def lock_for(pyproject: Path, cache: Path) -> Path | None:
    """uv.lock for `pyproject`, made by `uv lock` in a temporary copy (never in the user's tree)
    and kept under `cache` by the pyproject's sha256, so an unchanged one is locked once and its
    jobs get the same environment. None, said on stderr in one sentence, when uv is not here or
    cannot lock it: the job then runs with the project's files and no environment, as it would
    have before projects had one. Blocking."""
    text = pyproject.read_bytes()
    python_version = pyproject.parent / ".python-version"
    pin = python_version.read_bytes() if python_version.is_file() else b""
    digest = hashlib.sha256(text + b"\0" + pin).hexdigest()
    kept = cache / "locks" / f"{digest}.uv.lock"
    if kept.is_file():
        return kept
    uv = shutil.which("uv")
    if uv is None:
        print(
            "poolctl: uv is not installed here, so pyproject.toml goes without a lock and the job "
            "gets no environment of its own (install uv, or commit a uv.lock)",
            file=sys.stderr,
        )
        return None
    with tempfile.TemporaryDirectory(prefix="poolctl-lock-") as scratch:
        (Path(scratch) / "pyproject.toml").write_bytes(text)
        if pin:
            (Path(scratch) / ".python-version").write_bytes(pin)
        try:
            done = subprocess.run(
                [uv, "lock", "--quiet"], cwd=scratch, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=UV_LOCK_SECONDS, check=False,
            )  # fmt: skip
            failed, said = done.returncode != 0, done.stderr.decode(errors="replace")
        except subprocess.TimeoutExpired:
            failed, said = True, f"it took more than {UV_LOCK_SECONDS:g} s"
        made = Path(scratch) / "uv.lock"
        if failed or not made.is_file():
            reason = (said.strip().splitlines() or ["no reason given"])[-1]
            print(
                f"poolctl: `uv lock` could not lock pyproject.toml ({reason}), so the job gets no "
                "environment of its own (commit a uv.lock to choose one)",
                file=sys.stderr,
            )
            return None
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_suffix(f".{os.getpid()}.part")
        shutil.copyfile(made, partial)
        os.replace(partial, kept)
    return kept


def with_lock(project: Project, lock: Path) -> Project:
    """`project` with `lock` among its files, as uv.lock beside its pyproject.toml (at its top)."""
    st = lock.stat()
    added = ProjectFile("uv.lock", str(lock), st.st_size, st.st_mtime_ns, st.st_ino, st.st_mode)
    files = tuple(sorted((*project.files, added), key=lambda f: f.name))
    return Project(project.root, project.dir, files, project.commit, project.dirty)
