"""`poold`: the pool daemon. Server mode by default, worker mode with --worker.

Shutdown is two-phase: the first SIGINT/SIGTERM asks the daemon to stop (drain, then tidy up);
a second one cancels what is left at once. Either way the embedded redis-server is stopped.
SIGHUP reloads what can change without a restart (daemon/reload.py) and stops nothing: a closed
terminal or a dropped ssh session sends it. Nor does the loss of that terminal stop poold: a log
line it cannot write there is dropped (log_setup.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

import uvloop

from daemon import config as config_mod
from daemon import log_setup, object_store
from daemon.aio import TaskSet
from daemon.errors import ConfigError, GpupoolError
from daemon.reload import LIVE_EVERYWHERE, LIVE_ON_SERVER, Reloader
from daemon.server.service import PoolServer
from daemon.worker import native, non_root
from daemon.worker.hosted import hosted_worker
from daemon.worker.service import AgentDaemon, WorkerDaemon, local_slots

log = logging.getLogger("poold")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="poold", description="gpupool daemon: the pool server, or a worker.")
    p.add_argument("--worker", action="store_true", help="run as a worker on this machine's GPUs")
    p.add_argument("--print-config", action="store_true", help="print the effective configuration and exit")
    bucket = "create the S3 bucket the configuration names (main_server_minio_*), if missing, and exit"
    p.add_argument("--make-bucket", action="store_true", help=bucket)
    # The names for a pilot worker's options (also --worker-idle-exit, --worker-max-lifetime,
    # --worker-serve-user)
    for flag, name in (("--idle-exit", "worker_idle_exit"), ("--max-lifetime", "worker_max_lifetime")):
        p.add_argument(flag, dest=name, default=None, metavar="SECONDS", help=f"worker: {name}")
    serve = "worker: worker_serve_user, the one pool user whose jobs it runs"
    p.add_argument("--serve-user", dest="worker_serve_user", default=None, metavar="USER", help=serve)
    config_mod.add_flags(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    # Until the event loop handles it (_run), and after: a lost terminal's SIGHUP kills no poold.
    # Ignored, not handled, only while no child is started: an ignored signal stays so in a child.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    args = parser().parse_args(argv)
    if args.worker:  # before anything secret is read: no process of this uid may read it out of us
        try:
            native.require()  # a package built without the worker's C module (setup.py)
            non_root.make_non_dumpable()
        except GpupoolError as exc:
            print(f"poold: {exc}", file=sys.stderr)
            return 1
    try:
        config = config_mod.load(args)
    except ConfigError as exc:
        print(f"poold: {exc}", file=sys.stderr)
        return 2
    if args.print_config or args.make_bucket:
        return _one_shot(args, config)
    try:  # before anything starts: the server's own slots are a worker's (native.py)
        if config.embedded and config.worker_local_processors != 0:
            native.require(", or run only the server here with worker_local_processors = 0")
    except native.NotBuilt as exc:
        print(f"poold: {exc}", file=sys.stderr)
        return 1
    log_setup.setup(config.log_format, config.log_level)
    for sentence in config.renamed:
        log.warning("%s", sentence)
    try:
        if args.worker:  # it may leave by itself (a pilot worker): then it stops as on a signal
            # Through the server (an agent: no Redis or S3 credential), or on its own.
            worker = AgentDaemon(config) if config.worker_via_server else WorkerDaemon(config)
            return uvloop.run(_run(worker, worker.leaving, Reloader(args, config, LIVE_EVERYWHERE)))
        # The server runs an embedded pool's local slots as a Worker, and a Worker for each agent
        # (worker/hosted.py), which main hands it.
        server = PoolServer(config, local_slots, hosted_worker)
        return uvloop.run(_run(server, None, Reloader(args, config, LIVE_ON_SERVER, server.reload)))
    except GpupoolError as exc:
        log.error("%s", exc)
        return 1


def _one_shot(args: argparse.Namespace, config: config_mod.Config) -> int:
    """`--print-config` or `--make-bucket`: do it and exit, starting nothing."""
    if args.print_config:
        try:
            for name, value in config.shown().items():
                print(f"{name} = {value!r}  # {config.sources[name]}")
            sys.stdout.flush()
        except BrokenPipeError:  # `poold --print-config | head`: its reader has all it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush is quiet
        return 0
    try:  # the one thing a multinode pool needs that no poold creates by itself
        print(f"poold: {uvloop.run(object_store.make_bucket(config))}")
    except GpupoolError as exc:
        print(f"poold: {exc}", file=sys.stderr)
        return 1
    return 0


class Daemon(Protocol):
    """What main drives: the server (PoolServer) or a worker (WorkerDaemon)."""

    async def start(self) -> None:
        """Start; one that fails or is cancelled has stopped what it started (aio.start_or_undo)."""

    async def stop(self) -> None: ...

    def force(self) -> None: ...


async def _run(
    daemon: Daemon, stop: asyncio.Event | None, reload: Callable[[], Coroutine[Any, Any, None]]
) -> int:
    """Start `daemon`, wait for SIGINT/SIGTERM, stop it. While starting, a signal gives up at once;
    once started, the first asks for a graceful stop (running jobs may finish) and a second makes
    the daemon stop its jobs now (`force`). A started daemon is always stopped, and one whose start
    failed has stopped itself, so nothing is left behind. The daemon may set `stop` itself, to
    leave: that counts as the first signal. SIGHUP, while it runs, calls `reload`."""
    stop = asyncio.Event() if stop is None else stop
    main_task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    started = False
    reloads = TaskSet("SIGHUP: %s failed")

    def on_signal(sig: signal.Signals) -> None:
        if not stop.is_set():
            log.info("%s: stopping; running jobs may finish (send it again to stop at once)", sig.name)
            stop.set()
        elif started:
            log.warning("%s again: stopping jobs now and handing them back", sig.name)
            daemon.force()
        if not started and main_task is not None:
            main_task.cancel()  # still starting (e.g. waiting for Redis): give up at once

    def on_hangup() -> None:
        if started and not stop.is_set():
            reloads.spawn(reload(), "the reload")
        else:
            log.info("SIGHUP: nothing reloaded while poold %s", "stops" if started else "starts")

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    loop.add_signal_handler(signal.SIGHUP, on_hangup)
    try:
        try:
            await daemon.start()
        except asyncio.CancelledError:
            if not stop.is_set():
                raise
            return 0
        started = True
        try:
            await stop.wait()
        finally:
            await reloads.stop()
            await daemon.stop()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as before the loop: to the process's end
    return 0


if __name__ == "__main__":
    sys.exit(main())
