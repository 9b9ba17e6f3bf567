"""GPU memory packing on a real GPU, with the worker's own code (daemon/worker/gpus.py): NVML
discovery, the shared table with NVML's free memory, two --gpu-mem jobs placed on one GPU by
allocate_shared, each process seeing exactly that GPU through CUDA_VISIBLE_DEVICES and holding
its memory there; the GPU not free whole meanwhile, a third job with no room (the cap of 2), the
runner's dirty check seeing both pids, and the GPU clean and whole again after.

Run on a machine with an NVIDIA GPU: `python bench/gpu/share_check.py` (results: bench/README.md)."""

import os
import subprocess
import sys
import time

# On a GPU machine without the project's venv (it is too big to carry there), only pynvml needs to
# travel (in `.devcheck/site`): the metrics module gpus.py names, with its psutil and redis, is
# stood in for (bench/gpu/common.py), since nothing here samples metrics.
sys.path[:0] = [".devcheck/site", "."]
from bench.gpu.common import stand_in_worker_metrics  # noqa: E402

stand_in_worker_metrics()
from daemon.worker.gpus import GpuAllocator, discover  # noqa: E402

GIB = 2**30
JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_job.py")
gpus, nvml = discover()
print("discovered:", [(g.index, g.name, round(g.memory / GIB, 1), g.uuid, g.parent) for g in gpus])
if nvml is None or not gpus:
    sys.exit("no NVIDIA GPU here: nothing to check")
uuids = [g.uuid for g in gpus]
alloc = GpuAllocator(gpus, slots=4, max_jobs_per_gpu=2)
print("table before:", alloc.shared_table(nvml.free_memory(uuids)))
jobs = []
for name in ("a", "b"):
    room = alloc.shared_table(nvml.free_memory(uuids))[0]
    gpu = alloc.allocate_shared(name, room.uuid, 40 * GIB)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpu.uuid)
    jobs.append(
        subprocess.Popen(
            [sys.executable, JOB, gpu.uuid, str(40 * GIB), "6"], env=env, stdout=subprocess.PIPE, text=True
        )
    )
for p in jobs:
    assert p.stdout is not None
    for line in p.stdout:
        print(f"job {p.pid}: {line.rstrip()}")
        if line.startswith(("allocated", "cuMemAlloc", "cuInit")):
            break
free = nvml.free_memory(uuids)
print(f"NVML free while both run: {free[uuids[0]] / GIB:.1f} GiB")
print("table while both run:", alloc.shared_table(free), "(cap 2: no room for a third)")
print("free whole while shared:", alloc.free())
print("pids on the GPU (the runner's dirty check):", nvml.compute_pids(uuids[0]))
print("the jobs' pids:", [p.pid for p in jobs])
bogus = subprocess.run(
    [sys.executable, JOB, "-", "0", "0"],
    check=False,
    capture_output=True,
    text=True,
    env=dict(os.environ, CUDA_VISIBLE_DEVICES="GPU-00000000-0000-0000-0000-000000000000"),
)
print("a job given a GPU that is not there:", bogus.stdout.strip() or bogus.stderr.strip())
for p in jobs:
    p.wait(timeout=60)
    print(f"job {p.pid} exited {p.returncode}")
for name in ("a", "b"):
    alloc.release(name)
time.sleep(0.5)
print("pids on the GPU after:", nvml.compute_pids(uuids[0]))
print("free whole after:", [g.uuid for g in alloc.free()])
print("table after:", alloc.shared_table(nvml.free_memory(uuids)))
nvml.close()
