-- claim/job.lua: a queued job as the scheduler sees it, read by name from its record. What the
-- scheduler needs of a job is copied into named fields when it is enqueued (lib/enqueue.lua add_job):
-- the spec stays opaque here, read only to hand it to the worker that starts the job. A job is
-- read whole in one look where it is likely to be taken (`of`); a look at many jobs, most of which
-- stay where they are (backfill, the held lines), reads only what a verdict needs (`peek`), and
-- reads the one it takes again, whole.

-- A record of before 'gpu_mem_bytes' says MiB, in 'gpu_mem' (looked up only for such a record: a
-- field a record lacks costs a whole scan of a small one).
function job.old_gpu_mem(jobkey)
  return (tonumber(redis.call('HGET', jobkey, 'gpu_mem')) or 0) * 1048576
end

-- Job `id`: {id, key, state, gpus (asked; 0: a slot's share), attempt, user, seq, priority, entry,
-- mem (bytes on one shared GPU; 0: whole GPUs), spec (packed, opaque), limit and grace (its time
-- limit and its own stop grace as stored, in ms: `limits_of`), cpus and mem_bytes (the CPUs and
-- bytes of memory it needs on its worker, host.lua; 0: none asked, as a record of before them)}.
function job.of(id)
  local jobkey = job_key(req.prefix, id)
  local v = redis.call('HMGET', jobkey, 'state', 'gpus', 'attempt', 'user', 'seq', 'priority', 'entry',
    'gpu_mem_bytes', 'spec', 'time_limit_ms', 'stop_grace_ms', 'cpus', 'mem_bytes')
  return {
    id = id, key = jobkey, state = v[1], gpus = tonumber(v[2]) or 0, attempt = tonumber(v[3]) or 0,
    user = v[4] or '', seq = tonumber(v[5]), priority = tonumber(v[6]) or 0, entry = v[7],
    mem = tonumber(v[8]) or job.old_gpu_mem(jobkey), spec = v[9], limit = v[10], grace = v[11],
    cpus = tonumber(v[12]) or 0, mem_bytes = tonumber(v[13]) or 0,
  }
end

-- Job `id` as a verdict needs it (fit.lua), and no more: {id, key, state, gpus, user, mem, limit,
-- grace, cpus, mem_bytes}, as `of` has them.
function job.peek(id)
  local jobkey = job_key(req.prefix, id)
  local v = redis.call('HMGET', jobkey, 'state', 'gpus', 'user', 'gpu_mem_bytes', 'time_limit_ms', 'stop_grace_ms',
    'cpus', 'mem_bytes')
  return {
    id = id, key = jobkey, state = v[1], gpus = tonumber(v[2]) or 0, user = v[3] or '',
    mem = tonumber(v[4]) or job.old_gpu_mem(jobkey), limit = v[5], grace = v[6],
    cpus = tonumber(v[7]) or 0, mem_bytes = tonumber(v[8]) or 0,
  }
end

-- A record of before 'time_limit_ms' has its limits in its spec only: {time limit, stop grace} in
-- ms as the enqueue scripts now copy them out (0: none; -1: the worker's grace).
function job.old_limits(spec)
  local ok, s = pcall(cmsgpack.unpack, spec or '')
  if not ok or type(s) ~= 'table' then return {0, -1} end
  local limit = type(s.timeout) == 'number' and s.timeout * 1000 or 0
  return {limit, type(s.stop_grace) == 'number' and s.stop_grace * 1000 or -1}
end

-- A job's time limit and its own stop grace (ms; nil: none, and the worker's).
function job.limits_of(j)
  local v = j.limit and {j.limit, j.grace} or job.old_limits(j.spec or redis.call('HGET', j.key, 'spec'))
  local limit, grace = tonumber(v[1]) or 0, tonumber(v[2]) or -1
  return limit > 0 and limit or nil, grace >= 0 and grace or nil
end
