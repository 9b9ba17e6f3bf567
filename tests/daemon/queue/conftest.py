"""The queue tests' Redis: a test that asks for `either_redis` runs against one redis-server and
against a Redis Cluster of three primaries (tests/support/cluster.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import cast

import pytest

from daemon.queue.connection import AnyRedis
from daemon.queue.embedded_redis import EmbeddedRedis
from tests.support.cluster import ClusterServer

Server = EmbeddedRedis | ClusterServer


@pytest.fixture(params=["one redis", "cluster"])
def server(request: pytest.FixtureRequest) -> Server:
    """The queue's Redis: one redis-server, or a Redis Cluster."""
    name = "redis_server" if request.param == "one redis" else "cluster_server"
    return cast(Server, request.getfixturevalue(name))


@pytest.fixture
async def either_redis(server: Server) -> AsyncIterator[AnyRedis]:
    client = server.client()
    yield client
    await client.aclose()
