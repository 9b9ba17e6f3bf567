-- Helpers shared by every script; daemon/scripts.py prepends this file to each one at load time.
-- Every key derived here comes from a queue's key prefix, so it carries that queue's hash tag and
-- lives in the same Redis Cluster slot as the script's declared KEYS.

-- Redis server time in ms: leases are judged by this one clock, never by the workers' clocks.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Close the newest attempt in a job's history, if it is still open.
local function close_attempt(jobkey, how, now)
  local hist = jobkey .. ':attempts'
  local last = redis.call('LINDEX', hist, -1)
  if last then
    local a = cjson.decode(last)
    if a.how == 'running' then
      a.how = how
      a.ended_at = now
      redis.call('LSET', hist, -1, cjson.encode(a))
    end
  end
end

-- Drop a job's stream entry: acknowledged (out of the pending list) and deleted.
local function drop_entry(stream, group, entry)
  if entry then
    redis.call('XACK', stream, group, entry)
    redis.call('XDEL', stream, entry)
  end
end

-- Move a job to a terminal state: the record, the stream entry, an event for waiters, and the
-- retention countdown of every key of the job.
local function finish(stream, group, events, jobkey, id, state, now, retention)
  local j = redis.call('HMGET', jobkey, 'entry', 'idem', 'enqueued_at', 'started_at')
  drop_entry(stream, group, j[1])
  redis.call('HSET', jobkey, 'state', state, 'ended_at', now)
  -- the times ride along so that whoever reads events (metrics) needs no second round trip
  redis.call('XADD', events, 'MAXLEN', '~', 10000, '*', 'job', id, 'state', state,
    'enqueued_at', j[3] or '', 'started_at', j[4] or '', 'ended_at', now)
  for _, k in ipairs({jobkey, jobkey .. ':attempts', jobkey .. ':log'}) do
    redis.call('EXPIRE', k, retention)
  end
  if j[2] then redis.call('EXPIRE', j[2], retention) end
end

-- Put a started job back at the front of its queue: `retry` is served before the stream, in
-- enqueue order; its entry stays pending (owned by the 'reclaimed' consumer) so it is never trimmed.
local function requeue(stream, group, retry, jobkey, id)
  local j = redis.call('HMGET', jobkey, 'seq', 'entry')
  redis.call('HSET', jobkey, 'state', 'queued', 'worker', '')
  redis.call('ZADD', retry, j[1], id)
  redis.call('XCLAIM', stream, group, 'reclaimed', 0, j[2], 'JUSTID')
end

-- Wake workers blocked on the stream (XREAD from their cursor); claim drops the marker.
local function wake(stream)
  redis.call('XADD', stream, '*', 'wake', '1')
end

-- Take `n` sequence numbers of a queue, creating its stream and consumer group the first time.
-- Returns the first of them.
local function reserve(stream, seqkey, group, n)
  if redis.call('EXISTS', stream) == 0 then
    redis.call('XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM')
  end
  return redis.call('INCRBY', seqkey, n) - n + 1
end

-- Add a job at the tail of its queue with sequence number `seq` (from reserve): record, stream
-- entry and index entry. The caller has made sure its id is free.
local function add_job(stream, index, jobkey, id, seq, now, spec, gpus, max_attempts, retries)
  local entry = redis.call('XADD', stream, '*', 'job', id)
  redis.call('HSET', jobkey, 'id', id, 'state', 'queued', 'seq', seq, 'attempt', 0, 'spec', spec,
    'gpus', gpus, 'max_attempts', max_attempts, 'retries', retries, 'failures', 0,
    'enqueued_at', now, 'entry', entry)
  redis.call('ZADD', index, seq, id)
end
