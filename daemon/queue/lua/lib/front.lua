-- lib/front.lua: a job back at the front of its queue: handed back, reclaimed, retried.
--! include lib/record.lua

-- Put a job at the front of its queue (`front`, keys.py): served before the stream, in enqueue order; its
-- entry stays pending (owned by the 'reclaimed' consumer) so it is never trimmed.
local function to_front(prefix, stream, group, front, id)
  local j = redis.call('HMGET', job_key(prefix, id), 'seq', 'entry')
  redis.call('ZADD', front, j[1], id)
  redis.call('XCLAIM', stream, group, 'reclaimed', 0, j[2], 'JUSTID')
end

-- A started job queued again, its attempt over: to be claimed with attempt+1.
local function unstarted(prefix, id)
  redis.call('HSET', job_key(prefix, id), 'state', 'queued', 'worker', '')
  redis.call('HDEL', job_key(prefix, id), 'requeue')  -- asked for (requeue.lua), and done
end

-- Put a started job back at the front of its queue, to be claimed again with attempt+1.
local function requeue(prefix, stream, group, front, id)
  unstarted(prefix, id)
  to_front(prefix, stream, group, front, id)
  wake(prefix)
end

-- A failed job with retries left (complete.lua), its `failures` counted already: back to the
-- front at once with no back-off (`base` 0), else after `base` ms doubled for each failure before
-- this one, at most `most`: queued meanwhile in `backoff` (scored by when it is due), its entry
-- pending under 'reclaimed' as a front job's, where no claim looks; the reaper's pass
-- (reclaim.lua) puts it at the front once due.
local function retry_after(prefix, stream, group, front, id, failures, base, most, now)
  if base <= 0 then return requeue(prefix, stream, group, front, id) end
  unstarted(prefix, id)
  redis.call('ZADD', prefix .. 'backoff', now + math.min(base * 2 ^ (failures - 1), most), id)
  redis.call('XCLAIM', stream, group, 'reclaimed', 0, redis.call('HGET', job_key(prefix, id), 'entry'), 'JUSTID')
end
