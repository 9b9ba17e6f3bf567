"""Prometheus metrics: one registry per daemon, typed methods to record, and an HTTP endpoint.

Callers never touch prometheus_client objects: the server records through
`server.ServerMetrics`, a worker through `worker.WorkerMetrics` (`job_started(queue)`,
`heartbeat(rtt_s)`, ...), and `endpoint.serve_for` serves either on its configured address.
`common` holds what both share (a registry of their own, the process series, bounded queue
labels); `transfers.MeteredStore` counts the bytes a worker moves to and from the object store.

Names follow Prometheus conventions: a `gpupool_` prefix, base units (`_seconds`, `_bytes`, ratios
from 0 to 1 rather than percent), `_total` on counters. Label values are bounded: queue names (and
at most `common.MAX_QUEUES` of those, the rest are summed under `"_other"`), terminal states, error
code names, GPU indexes; never job or worker ids.

metrics/ records and exposes; the server and the worker feed it and it imports neither
(daemon/metrics/ruff.toml). NVML in particular is read by daemon/worker/gpus.py, which hands
`WorkerMetrics` a sampler. Import the module you need; this package re-exports nothing.
"""
