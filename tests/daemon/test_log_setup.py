"""Debug logging is gpupool's own: a library at debug level prints secrets (issue 14, finding 10)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from daemon import log_setup


@pytest.fixture
def restored() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    own = {name: logging.getLogger(name).level for name in log_setup.OWN_LOGGERS}
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for name, was in own.items():
            logging.getLogger(name).setLevel(was)


@pytest.mark.usefixtures("restored")
def test_debug_level_is_for_gpupools_loggers_only() -> None:
    log_setup.setup("text", "debug")
    assert logging.getLogger("daemon.worker.runner").isEnabledFor(logging.DEBUG)
    assert logging.getLogger("storage.s3").isEnabledFor(logging.DEBUG)
    for library in ("botocore.auth", "aiobotocore", "redis", "asyncio"):
        assert not logging.getLogger(library).isEnabledFor(logging.INFO), library
        assert logging.getLogger(library).isEnabledFor(logging.WARNING), library


@pytest.mark.usefixtures("restored")
def test_a_quieter_level_applies_to_everything() -> None:
    log_setup.setup("text", "error")
    assert not logging.getLogger("daemon.main").isEnabledFor(logging.WARNING)
    assert not logging.getLogger("botocore").isEnabledFor(logging.WARNING)
