-- lib/enqueue.lua: what the enqueue scripts add: sequence numbers and a job's record.
--! include lib/arrays.lua

-- Take `n` sequence numbers of a queue, creating its stream and consumer group the first time.
-- Returns the first of them.
local function reserve(stream, seqkey, group, n)
  if redis.call('EXISTS', stream) == 0 then
    redis.call('XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM')
  end
  return redis.call('INCRBY', seqkey, n) - n + 1
end

-- Priorities: a job enqueued with priority P > 0 is also in its queue's `prio` ZSET, scored so
-- that the highest priority, then the lowest seq, comes first; claims take it before the stream
-- (claim.lua). PRIO_SEQ (above, with `join`) exceeds any seq a queue will reach.

-- What an enqueue script is given of each job, in this order in its ARGV (job_queue.py
-- `_job_args` writes them so): its spec (msgpack, opaque to every script), the GPUs it wants, its
-- max attempts and retries, its priority (0: none), its user (whose caps it counts against), the
-- bytes it asks for on one shared GPU (0: whole GPUs), what it waits for ("JOB:how ...",
-- daemon/after.py; '' for nothing), its array ('QUEUE@NAME'; '' for none), its place in it, the
-- array's window (the most of it under way at once; 0: no limit), where its end is notified
-- ('job', 'pool', both space-separated, or '': to_outbox), its time limit (ms; 0: none) and its
-- own stop grace (ms; -1: the worker's), and the CPUs and bytes of memory it needs on its worker (0:
-- none asked; claim/host.lua). The scheduler reads what it needs of a job from these
-- named fields of its record (claim/job.lua), never from the spec.
local JOB_ARGS = {'spec', 'gpus', 'max_attempts', 'retries', 'priority', 'user', 'gpu_mem_bytes', 'after', 'array',
  'array_pos', 'window', 'notify', 'time_limit_ms', 'stop_grace_ms', 'cpus', 'mem_bytes'}

-- The job given at ARGV[first] and on, as a table keyed by JOB_ARGS.
local function job_args(argv, first)
  local a = {}
  for i, name in ipairs(JOB_ARGS) do a[name] = argv[first + i - 1] end
  return a
end

-- Add a job (`a`: job_args) at the tail of its queue with sequence number `seq` (from reserve):
-- its record and index entry, and its place in its array. The caller has made sure its id is
-- free. A job that waits for others to end (`a.after`) is held in `waiting`, with what it waits
-- for on its record, and listed in `depends`, where the server's judge finds it, till ready.lua;
-- one of an array with a window goes in its turn (`take_turn`); any other joins the queue at once. All in the one call, so
-- no crash leaves a job held with nothing to say what it waits for.
local function add_job(prefix, index, jobkey, id, seq, now, a)
  local priority, pos, window = tonumber(a.priority) or 0, tonumber(a.array_pos) or 0, tonumber(a.window) or 0
  redis.call('HSET', jobkey, 'id', id, 'state', 'queued', 'seq', seq, 'attempt', 0, 'spec', a.spec,
    'gpus', a.gpus, 'max_attempts', a.max_attempts, 'retries', a.retries, 'failures', 0, 'losses', 0,
    'enqueued_at', now, 'entry', '', 'priority', priority, 'user', a.user or '',
    'gpu_mem_bytes', tonumber(a.gpu_mem_bytes) or 0, 'time_limit_ms', tonumber(a.time_limit_ms) or 0,
    'stop_grace_ms', tonumber(a.stop_grace_ms) or -1, 'cpus', tonumber(a.cpus) or 0, 'mem_bytes', tonumber(a.mem_bytes) or 0,
    'after', a.after or '', 'array', a.array or '', 'array_pos', pos, 'window', window, 'counted', 1)
  if a.notify and a.notify ~= '' then redis.call('HSET', jobkey, 'notify', a.notify) end
  redis.call('ZADD', index, seq, id)
  redis.call('HINCRBY', prefix .. 'unended', a.user or '', 1)
  if a.array and a.array ~= '' then
    local key = array_key(prefix, a.array)
    redis.call('ZADD', key, pos, id)
    redis.call('INCR', key .. ':left')
    redis.call('PERSIST', key)  -- (an earlier batch of it may have ended, and set it expiring)
    redis.call('PERSIST', key .. ':left')
  end
  if a.after and a.after ~= '' then
    redis.call('ZADD', prefix .. 'waiting', seq, id)
    redis.call('ZADD', prefix .. 'depends', seq, id)  -- what the server's sweep judges
  elseif window > 0 then
    redis.call('ZADD', prefix .. 'waiting', seq, id)
    take_turn(prefix, id, a.array, pos, window)
  else
    join(prefix, jobkey, id, priority, seq)
  end
end
