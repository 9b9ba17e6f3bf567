"""A job's checkpoint directory, carried from one attempt to the next through the object store.

Each job has `$GPUPOOL_CHECKPOINT_DIR` (a directory of its slot, empty when it starts). What the job
leaves there is saved at the end of an attempt that another may follow (handed back by a requeue
or a drain, or failed with retries), and every `checkpoint_every` seconds while it runs (`poolctl
enqueue --checkpoint-every`), so that a worker that dies leaves its last save behind. The next
attempt starts with the newest save of an earlier attempt in its directory: a job that writes its
state there on SIGTERM, and reads it at its start, resumes instead of starting over.

A save is `checkpoints/<job>/<lease>.<n>/<files>` (`object_store.checkpoint_prefix`, the lease id
as `object_store.attempt_segment` quotes it), then a marker `checkpoints/<job>/<lease>.<n>.done`,
written last: a save cut short (the worker died during it) has no marker and is never restored.
Saves of one attempt are numbered in order. They are named by the attempt's lease id, not its
number, because the number can repeat: after Redis lost a claim, the job is claimed again with the
same number while the forgotten execution may still run and save. So no execution's saves ever
mix with or replace another's, and a zombie cannot spoil what the attempt after it saved.

Which save is restored: the one the job's record names (its `checkpoint` field), which an
attempt records, after the marker, through a fenced script (queue/lua/checkpoint.lua) only while
it holds the job and its lease has not expired. A save by an attempt the pool has taken back (a
worker stopped past its lease: another attempt may hold the job and save by now) is written to
the store but never recorded, so never restored; nor is a save of an execution the pool forgot
(Redis lost its claim), which holds nothing. The record must name an attempt of the job's history
(`job:ID:attempts`). A job with no save recorded (its saves made before saves were recorded)
restores the newest save of its newest attempt from before lease ids (no lease in its history
entry), matched to saves named by their number (`<attempt>.<n>`), as they were written then.

A job should write its files whole (to a temporary name, then rename): a periodic save copies what
is there at that moment.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import stat
from collections.abc import Callable, Generator, Sequence
from pathlib import Path, PurePosixPath

from daemon.errors import StaleAttempt
from daemon.job import Attempt, Lease
from daemon.object_store import attempt_segment, checkpoint_prefix
from daemon.worker.job_data import files_under, has_entries
from daemon.worker.pool_link import UNREACHABLE, PoolLink
from storage.base import ObjectStore
from storage.content import CHUNK, iterate_in_thread

log = logging.getLogger(__name__)

HISTORY_RETRY = 1.0  # pause between reads of a job's history while Redis is away

DONE = ".done"


# A marker's name: the saving attempt's name (no "/": one key segment), a dot, the save's number.
SAVE_NAME = re.compile(r"([^/]+)\.([0-9]+)")


def _save_name(prefix: str, key: str) -> tuple[str, int] | None:
    """(attempt's name, n) of a marker's key, `prefix` + "NAME.N.done"; None for any other key
    (a file of a save, whatever the job named it, is under a "NAME.N/" directory)."""
    match = SAVE_NAME.fullmatch(key.removeprefix(prefix).removesuffix(DONE))
    if not key.startswith(prefix) or not key.endswith(DONE) or match is None:
        return None
    return match[1], int(match[2])


def saved_as(attempt: Attempt) -> str:
    """The name `attempt`'s saves have: its lease id; its number when its history entry has no
    lease id (written before claims recorded one, when saves were named by number)."""
    return attempt_segment(attempt.lease) if attempt.lease else str(attempt.attempt)


async def counted_attempts(
    queue: PoolLink, lease: Lease, lost: Callable[[], bool]
) -> tuple[list[Attempt], str]:
    """The attempts of `lease`'s job the pool knows ran before it, oldest first (its history in
    Redis, whose saves alone may be restored), and the save its record names ('' for none).
    While Redis does not answer it is asked again, as an outcome is offered, until the attempt is
    `lost` (its lease deadline passed unrenewed: the fence; then none); a job is not failed for a
    Redis that is briefly away."""
    while True:
        try:
            info = await queue.get(lease.job_id)
        except UNREACHABLE as exc:
            if lost():
                return [], ""  # it never starts (runner.py)
            log.warning("job %s: its history cannot be read (%s); asking again", lease.job_id, exc)
            await asyncio.sleep(HISTORY_RETRY)
            continue
        return [a for a in info.attempts if a.lease != lease.id], info.checkpoint


async def restore(
    store: ObjectStore, job_id: str, history: Sequence[Attempt], recorded: str, dest: Path
) -> tuple[Attempt, int] | None:
    """Unpack into `dest` the save `recorded` (the job record's, "NAME.N") when an attempt of
    `history` (the job's earlier attempts, oldest first) made it; with none recorded, the newest
    save of the newest attempt from before lease ids that has one. That attempt and the save's
    number, or None when there is no such save. A save by an execution not in `history`, or one
    made while its attempt no longer held the job (never recorded), is never taken."""
    prefix = checkpoint_prefix(job_id)
    chosen = _recorded(history, recorded) if recorded else await _newest_by_number(store, prefix, history)
    if chosen is None:
        return None
    attempt, n = chosen
    name = f"{saved_as(attempt)}.{n}"
    for obj in await store.list(f"{prefix}{name}/"):
        relative = PurePosixPath(obj.key.removeprefix(f"{prefix}{name}/"))
        if not relative.parts or relative.is_absolute() or ".." in relative.parts:
            continue  # never written so (save names files under the directory): not followed
        target = dest.joinpath(*relative.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        await store.get_file(obj.key, target)
    return attempt, n


def _recorded(history: Sequence[Attempt], recorded: str) -> tuple[Attempt, int] | None:
    """The attempt of `history` that made the save `recorded` ("NAME.N"), and N; None for none."""
    match = SAVE_NAME.fullmatch(recorded)
    made_by = [a for a in history if match is not None and saved_as(a) == match[1]]
    return (made_by[-1], int(match[2])) if match is not None and made_by else None


async def _newest_by_number(
    store: ObjectStore, prefix: str, history: Sequence[Attempt]
) -> tuple[Attempt, int] | None:
    """With no save recorded: the newest complete save of the newest attempt of `history` from
    before lease ids (saves named by number, from before saves were recorded), and its number."""
    newest: dict[str, int] = {}
    for obj in await store.list(prefix):
        if (save := _save_name(prefix, obj.key)) is not None:
            newest[save[0]] = max(save[1], newest.get(save[0], 0))
    for attempt in reversed([a for a in history if not a.lease]):
        if (n := newest.get(saved_as(attempt))) is not None:
            return attempt, n
    return None


class Saver:
    """The saves of one attempt: `save()` at each period and once at the end, never two at once."""

    def __init__(self, store: ObjectStore, queue: PoolLink, lease: Lease, source: Path) -> None:
        self.store = store
        self.queue = queue
        self.lease = lease
        self.prefix = checkpoint_prefix(lease.job_id)
        self.name = attempt_segment(lease.id)  # never another execution's (module docstring)
        self.attempt = lease.attempt
        self.source = source
        self.saved = 0  # saves begun
        self._lock = asyncio.Lock()

    async def save(self) -> int:
        """Upload what the directory holds now, then its marker, then record it for the next
        attempt (only while this attempt holds the job); the number of files (0: nothing there,
        nothing saved). StaleAttempt when it was saved but not recorded: the attempt no longer
        holds the job, and its save is never restored."""
        async with self._lock:
            if not has_entries(self.source):
                return 0
            files = await asyncio.to_thread(files_under, self.source)
            self.saved += 1  # before any upload: a save cut short never shares its name with the next
            name = f"{self.name}.{self.saved}"
            saved = 0
            for relative, _ in files:
                try:
                    fd = await asyncio.to_thread(open_beneath, self.source, relative)
                except OSError:
                    continue  # gone, or made a link or a device since the walk: not the job's data
                await self.store.put_stream(f"{self.prefix}{name}/{relative}", iterate_in_thread(_chunks(fd)))
                saved += 1
            await self.store.put_bytes(f"{self.prefix}{name}{DONE}", b"")
            if not await self.queue.record_checkpoint(self.lease, name):
                raise StaleAttempt(self.lease.job_id, self.attempt, f"its checkpoint save {name} is not kept")
            return saved

    async def every(self, seconds: float) -> None:
        """Save every `seconds` until cancelled; a save that fails is said and tried at the next."""
        while True:
            await asyncio.sleep(seconds)
            try:
                await self.save()
            except StaleAttempt as exc:  # taken back: it saves nothing more (its job is another's)
                log.warning("job %s: %s", self.lease.job_id, exc)
                return
            except Exception as exc:  # noqa: BLE001 - the job runs on; the next save may work
                log.warning("checkpoint of attempt %d not saved (%s); trying again later", self.attempt, exc)


def open_beneath(root: Path, relative: str) -> int:
    """A read-only descriptor of the regular file `relative` under `root`, each component opened
    without following a symlink: the job may still be running (a periodic save), and as another
    uid than the worker's, so it could swap a file, or a directory on its path, for a link to
    what only the worker may read between the walk and the read. OSError when it is not a plain
    file reached that way."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        *dirs, last = relative.split("/")
        for part in dirs:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        file_fd = os.open(last, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(file_fd).st_mode):
        os.close(file_fd)
        raise OSError(f"{relative} is not a regular file")
    return file_fd


def _chunks(fd: int) -> Generator[bytes, None, None]:
    """The bytes of `fd`, which is closed at the end."""
    with os.fdopen(fd, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK):
            yield chunk
