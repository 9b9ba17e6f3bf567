"""A real `poold` server on a Sentinel group, as docs/OPERATIONS.md §9 sets one up, and `poolctl`
against it: a submit no replica confirmed is refused in one plain sentence, and the same submit
(same --key) goes through once the replica answers, as the same job."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from tests.support.poolctl import poolctl, researcher_env
from tests.support.poold_proc import poold
from tests.support.sentinel import SentinelGroup

TOKENS = {"alice": "alice-token-0123456789abcdef"}


async def test_poolctl_says_a_submit_no_replica_confirmed_is_not_acknowledged(
    sentinel_group: SentinelGroup, tmp_path: Path
) -> None:
    replica = next(n for n in sentinel_group.nodes if n is not sentinel_group.primary())
    assert replica.proc is not None
    ack = ("--redis-min-replicas-ack", "1", "--redis-replicas-ack-timeout", "0.3")
    with poold(sentinel_group, tmp_path, TOKENS, *ack) as address:
        env = researcher_env(tmp_path, address, "alice", TOKENS["alice"])
        code, out, _ = await poolctl(env, "enqueue", "--json", "--key", "first", "--", "true")
        assert code == 0, out
        os.kill(replica.proc.pid, signal.SIGSTOP)
        try:
            code, out, err = await poolctl(env, "enqueue", "--json", "--key", "second", "--", "true")
        finally:
            os.kill(replica.proc.pid, signal.SIGCONT)
        assert code != 0
        assert out == ""
        assert "only 0 of the 1 replicas" in err
        assert "not acknowledged" in err
        assert "same --key" in err
        code, out, err = await poolctl(env, "enqueue", "--json", "--key", "second", "--", "true")
        assert code == 0, err
        again = json.loads(out)
        assert again["created"] is False  # the refused submit's job, kept on the primary all along
