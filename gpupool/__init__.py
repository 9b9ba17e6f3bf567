"""gpupool from Python: submit functions and commands to a pool, get futures back.

    import gpupool

    with gpupool.connect() as pool:              # the pool poolctl talks to (pools.toml, env)
        job = pool.submit(evaluate, "ckpt.pt", gpus=1)
        print(job.result())                      # what evaluate returned, computed on a pool GPU
        jobs = pool.map(score, range(100))       # one array; results in input order
        print([j.result() for j in jobs])

A Job is a concurrent.futures.Future (and awaitable); `pool.job(id)` finds one again from any
process. The function and its arguments are pickled here and unpickled only in the job, which
runs in a copy of this process's project and environment; its result comes back the same way.
"""

from gpupool.errors import BadArgument, Error, JobFailed, RemoteError, RemoteTraceback
from gpupool.executor import PoolExecutor
from gpupool.job import Job
from gpupool.options import Options
from gpupool.pool import Pool, connect

__all__ = [
    "BadArgument",
    "Error",
    "Job",
    "JobFailed",
    "Options",
    "Pool",
    "PoolExecutor",
    "RemoteError",
    "RemoteTraceback",
    "connect",
]
