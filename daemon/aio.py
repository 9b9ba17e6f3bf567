"""Small asyncio helpers the worker needs.

`cancel_and_wait` exists because a cancellation can be lost on Python 3.11: `asyncio.wait_for`,
which redis-py uses while it connects and reads, returns the result instead of raising
CancelledError when the operation it guards completes in the same loop iteration as the cancel
(CPython gh-86296, fixed in 3.12). A task cancelled once may then run on, for example into a
blocking XREAD; cancelling again until it has ended is what makes stopping it reliable.
"""

from __future__ import annotations

import asyncio
from typing import Any

RECANCEL_SECONDS = 0.05


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel `task` (again, should a cancellation be lost) until it has ended. Its own outcome
    (result, exception or cancellation) is left in it for the caller to inspect."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_SECONDS)
