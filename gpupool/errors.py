"""What `import gpupool` raises: one hierarchy under daemon/errors.py's, each error a sentence.

`Error` is the base: catch it to catch everything the API says went wrong, on the pool's side or
in what it was given. A function's own exception is not one of these: it is raised again as it was
raised in the job, with the job's traceback as its `__cause__` (`RemoteTraceback`), as
concurrent.futures.ProcessPoolExecutor does.
"""

from __future__ import annotations

from daemon.errors import GpupoolError
from protocol import ErrorCode

# The base of every error the API raises: daemon/errors.py's, so that a pool that does not answer
# (ServerUnreachable), a refused token (AuthFailed) and the errors below are all caught by it.
Error = GpupoolError


class BadArgument(Error, ValueError):
    """An argument the API cannot use (gpus=-1, a function that is not callable, an argument that
    cannot be pickled): the sentence says which and what it must be. Nothing was queued."""

    code = ErrorCode.INVALID_ARGUMENT


class JobFailed(Error):
    """A job ended without a result: killed, timed out, cancelled, dead, or its command exited with
    a status other than 0. The sentence names the job, its state and the end of its log."""

    code = ErrorCode.INTERNAL

    def __init__(self, job_id: str, state: str, detail: str, log_tail: str) -> None:
        why = f" ({detail})" if detail else ""
        tail = f"; the end of its log:\n{log_tail.rstrip()}" if log_tail.strip() else "; its log is empty"
        super().__init__(f"job {job_id} ended {state}{why} with no result{tail}")
        self.job_id = job_id
        self.state = state
        self.detail = detail
        self.log_tail = log_tail


class RemoteError(Error):
    """The function raised an exception that could not be pickled to come back, or one that is
    not an Exception (SystemExit, KeyboardInterrupt: raised again here, it would end the caller):
    its type and message, and the job's traceback."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a job, as text: the `__cause__` of the exception
    raised again here, so that the traceback printed shows where in the job it was raised."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'
