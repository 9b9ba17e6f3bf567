#!/usr/bin/env bash
# Issue 44 item 4 on a real GPU machine (the suite's test_confine.py uses stand-in device nodes):
# a job started by the worker's spawner, as a slot uid, opens only the GPU device nodes it was
# given, and CUDA still works on the one it was given. Run as root from the repository root,
# with the C module built (make install); prints what each job saw, exits 0 when all holds.
set -euo pipefail
exec timeout 120 "${PYTHON:-.venv/bin/python}" - <<'PY'
import asyncio, glob, os, shutil, sys
from pathlib import Path
from daemon.worker.gpus import discover
from daemon.worker.identity import SlotIdentity
from daemon.worker.spawn import Spawner

SLOT = SlotIdentity(61099, 61099)  # a uid of no real user's
PROBE = """
import errno, glob, os
for node in sorted(glob.glob("/dev/nvidia[0-9]*")):
    try:
        os.close(os.open(node, os.O_RDWR)); print(node, "opened")
    except OSError as exc:
        print(node, errno.errorcode[exc.errno])
"""

async def job(spawner, gpus, argv):
    env = {"PATH": os.environ["PATH"]}  # no CUDA_VISIBLE_DEVICES: as a job that unset it
    child = spawner.spawn(argv, cwd=Path("/"), env=env, identity=SLOT, gpus=gpus)
    out = await asyncio.to_thread(lambda: os.fdopen(child.output, "rb").read().decode())
    status = await asyncio.wait_for(child.wait(), 60)
    return status, out + (f"(not started: {child.start_error})\n" if child.start_error else "")

async def main():
    found, nvml = discover()
    if not found or found[0].minor is None:
        sys.exit("no GPU whose minor number NVML tells")
    given = found[0].minor
    spawner = Spawner()
    ok = True
    try:
        for gpus in ({given}, set()):
            status, out = await job(spawner, gpus, ["python3", "-c", PROBE])
            print(f"given {sorted(gpus)}: exit {status}\n{out}")
            ok &= status == 0 and len(out.splitlines()) == len(glob.glob("/dev/nvidia[0-9]*"))
            for line in out.splitlines():
                node, how = line.split()
                want = "opened" if node == f"/dev/nvidia{given}" and gpus else "EACCES"
                ok &= how == want
            if shutil.which("nvidia-smi"):
                status, out = await job(spawner, gpus, ["nvidia-smi", "-L"])
                print(f"nvidia-smi -L, given {sorted(gpus)}: exit {status}\n{out}")
                ok &= (status == 0) == bool(gpus)
    finally:
        await spawner.close()
        if nvml is not None:
            nvml.close()
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)

asyncio.run(main())
PY
