-- cancel: stop a job. A queued job never starts: it becomes cancelled at once (out of the front,
-- `parked`, `prio`, `backoff`, `waiting`, `depends` and the jobs held at a cap, its entry deleted,
-- so no claim can deliver it; out of its array's window, lib/finish.lua `finish`). A running job is
-- flagged: its worker learns it
-- on its next renew, stops the process and completes the attempt as cancelled; if that worker is
-- dead, the reaper cancels the job instead of requeueing it. A finished job is left as it is.
-- Safe to run twice (the second run finds the state the first left). At maxmemory it still runs:
-- its first write is a deletion, and stopping jobs is how memory comes back.
-- KEYS: 1 stream, 2 the front, 3 events
-- ARGV: 1 queue key prefix, 2 group, 3 job id, 4 retention (s), 5 why (optional: the record's
--       detail, for a job cancelled by the pool, as one whose dependency can no longer be met),
--       6 days the job's accounting record is kept (lib/account.lua; absent: its default)
-- Returns the job's state afterwards: 'cancelled' | 'cancelling' | the terminal state | 'missing'.
--! include lib/record.lua
--! include lib/finish.lua
--! include lib/caps.lua
local stream, front, events = KEYS[1], KEYS[2], KEYS[3]
local prefix, group, id = ARGV[1], ARGV[2], ARGV[3]
local jobkey = job_key(prefix, id)
local state = redis.call('HGET', jobkey, 'state')
if not state then return 'missing' end
if state == 'queued' then
  redis.call('ZREM', front, id)
  redis.call('ZREM', prefix .. 'parked', id)
  redis.call('ZREM', prefix .. 'prio', id)
  unhold(prefix, redis.call('HGET', jobkey, 'user') or '', id)
  redis.call('ZREM', prefix .. 'waiting', id)
  redis.call('ZREM', prefix .. 'depends', id)
  redis.call('ZREM', prefix .. 'backoff', id)
  finish(prefix, stream, group, events, id, 'cancelled', now_ms(), tonumber(ARGV[4]),
    nil, ARGV[5] and ARGV[5] ~= '' and {'detail', ARGV[5]} or nil, ARGV[6])
  return 'cancelled'
end
if state == 'running' then
  redis.call('ZREM', front, id)  -- a no-op, written first: at maxmemory a cancel still goes through
  redis.call('HSET', jobkey, 'cancel', '1')
  return 'cancelling'
end
return state
