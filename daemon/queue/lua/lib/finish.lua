-- lib/finish.lua: the one end of every job: counts, notifications, events, retention.
--! include lib/record.lua
--! include lib/arrays.lua
--! include lib/account.lua

-- How many finished jobs of a queue to forget per job that finishes, once past retention: the
-- index stays bounded by the jobs of the last `retention` seconds at a constant cost per finish.
local TRIM_PER_FINISH = 8

-- The fields of a job's record that `finish` reads, in this order (a caller that read them
-- already passes them on).
local FINISH_FIELDS = {'entry', 'idem', 'enqueued_at', 'started_at', 'array', 'window', 'user', 'counted'}

-- What each user has in a queue and has not ended, queued or running (issue 44 item 6): the
-- queue's `unended` HASH (user -> count), one more as `add_job` adds a job, one less as `finish`
-- ends one, in the scripts that do so, so it is exact: a requeue, a reclaim, a retry or an
-- array's or a dependency's wait moves a job between states that all count, and every end of a
-- job, however it comes, is `finish`, which runs once per job. The enqueue scripts refuse a
-- job that would take its user past their bound, in the same call, so concurrent enqueues
-- cannot pass it together. A job counted says so on its record ('counted'): one enqueued
-- before the count was kept was never counted, and its end takes nothing away. A user at 0
-- leaves the hash.
local function unended(prefix, user)
  return tonumber(redis.call('HGET', prefix .. 'unended', user)) or 0
end

local function uncount(prefix, user)
  local key = prefix .. 'unended'
  if redis.call('HINCRBY', key, user, -1) <= 0 then redis.call('HDEL', key, user) end
end

-- Webhooks (daemon/server/notifier.py): a job whose end is to be notified names, on its record,
-- the targets it goes to ('notify': 'job' for its --notify URL, 'pool' for notify_url, or both,
-- space-separated; written when it is enqueued). Its end puts one entry per target in the
-- queue's `outbox` (ZSET 'ID/TARGET' -> when it is due, ms), in the script that ends the job, so
-- no crash comes between an end and its notification; servers take them on (outbox_take.lua).
-- At OUTBOX_MAX entries the one due longest ago makes room, counted in `outbox_dropped` for a
-- server to report: a receiver down for long cannot grow the outbox without bound.
local OUTBOX_MAX = 100000
local function to_outbox(prefix, jobkey, id, now)
  local targets = redis.call('HGET', jobkey, 'notify')
  if not targets then return end
  local outbox = prefix .. 'outbox'
  for target in string.gmatch(targets, '%a+') do
    redis.call('ZADD', outbox, 'NX', now, id .. '/' .. target)
  end
  local over = redis.call('ZCARD', outbox) - OUTBOX_MAX
  if over > 0 then
    redis.call('ZPOPMIN', outbox, over)
    redis.call('INCRBY', prefix .. 'outbox_dropped', over)
  end
end

-- Move a job to a terminal state: the record (with `fields`, more field-value pairs to set at
-- once, if given), the stream entry, its notifications (to_outbox), an event for waiters, and
-- the retention countdown of every key of the job (the set of the jobs waiting for it too); the
-- next jobs of its array's window are let in; the queue's index forgets jobs past retention; its
-- accounting record is written, kept `days` days (lib/account.lua).
-- `j`: the job's FINISH_FIELDS, when the caller has read them.
local function finish(prefix, stream, group, events, id, state, now, retention, j, fields, days)
  local jobkey = job_key(prefix, id)
  j = j or redis.call('HMGET', jobkey, unpack(FINISH_FIELDS))
  drop_entry(stream, group, j[1])
  local set = {'state', state, 'ended_at', now}
  for _, v in ipairs(fields or {}) do set[#set + 1] = v end
  redis.call('HSET', jobkey, unpack(set))
  to_outbox(prefix, jobkey, id, now)
  account(prefix, jobkey, state, now, days)
  -- the times ride along so that whoever reads events (metrics) needs no second round trip
  redis.call('XADD', events, 'MAXLEN', '~', 10000, '*', 'job', id, 'state', state,
    'enqueued_at', j[3] or '', 'started_at', j[4] or '', 'ended_at', now)
  for _, k in ipairs({jobkey, jobkey .. ':attempts', jobkey .. ':log'}) do
    redis.call('EXPIRE', k, retention)
  end
  if j[2] then redis.call('EXPIRE', j[2], retention) end
  redis.call('EXPIRE', prefix .. 'dependents:' .. id, retention)  -- kept while the job lived
  if j[5] and j[5] ~= '' then array_ended(prefix, j[5], tonumber(j[6]) or 0, id, retention) end
  if j[8] == '1' then uncount(prefix, j[7] or '') end
  local ended, index = prefix .. 'ended', prefix .. 'jobs'
  redis.call('ZADD', ended, now, id)
  if redis.call('EXISTS', prefix .. 'capped') == 1 then wake(prefix) end  -- a cap may have room now
  local old = redis.call('ZRANGEBYSCORE', ended, '-inf', now - retention * 1000, 'LIMIT', 0, TRIM_PER_FINISH)
  if #old > 0 then
    redis.call('ZREM', ended, unpack(old))
    redis.call('ZREM', index, unpack(old))
  end
end
