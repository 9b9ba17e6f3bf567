-- claim/job.lua: a queued job as the scheduler sees it, read by name from its record. What the
-- scheduler needs of a job is copied into named fields when it is enqueued (lib/enqueue.lua add_job):
-- the spec stays opaque here, read only to hand it to the worker that starts the job (read with
-- the rest: most jobs a claim reads, it starts).
local JOB_FIELDS = {'state', 'gpus', 'attempt', 'user', 'seq', 'priority', 'entry', 'gpu_mem_bytes', 'spec'}

-- A record of before 'gpu_mem_bytes' says MiB, in 'gpu_mem' (looked up only for such a record: a
-- field a record lacks costs a whole scan of a small one).
local function old_gpu_mem(key)
  return (tonumber(redis.call('HGET', key, 'gpu_mem')) or 0) * 1048576
end

-- Job `id`: {id, key, state, gpus (asked; 0: a slot's share), attempt, user, seq, priority, entry,
-- mem (bytes on one shared GPU; 0: whole GPUs), spec (packed, opaque)}.
local function job_of(id)
  local key = job_key(prefix, id)
  local v = redis.call('HMGET', key, unpack(JOB_FIELDS))
  return {
    id = id, key = key, state = v[1], gpus = tonumber(v[2]) or 0, attempt = tonumber(v[3]) or 0,
    user = v[4] or '', seq = tonumber(v[5]), priority = tonumber(v[6]) or 0, entry = v[7],
    mem = tonumber(v[8]) or old_gpu_mem(key), spec = v[9],
  }
end

-- A record of before 'time_limit_ms' has its limits in its spec only: {time limit, stop grace} in
-- ms as the enqueue scripts now copy them out (0: none; -1: the worker's grace).
local function old_limits(spec)
  local ok, s = pcall(cmsgpack.unpack, spec or '')
  if not ok or type(s) ~= 'table' then return {0, -1} end
  local limit = type(s.timeout) == 'number' and s.timeout * 1000 or 0
  return {limit, type(s.stop_grace) == 'number' and s.stop_grace * 1000 or -1}
end

-- A job's time limit and its own stop grace (ms; nil: none, and the worker's), read the first
-- time a claim needs them (backfill and a pilot's end do; most claims never ask).
local function limits_of(j)
  if j.limits == nil then
    local v = redis.call('HMGET', j.key, 'time_limit_ms', 'stop_grace_ms')
    if not v[1] then v = old_limits(j.spec) end
    local limit, grace = tonumber(v[1]) or 0, tonumber(v[2]) or -1
    j.limits = {limit > 0 and limit or nil, grace >= 0 and grace or nil}
  end
  return j.limits[1], j.limits[2]
end
