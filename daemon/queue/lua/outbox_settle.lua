-- outbox_settle: what became of a delivery a server took from the outbox (outbox_take.lua).
-- Guarantees: only the holder changes the entry: its score must still be the fence its take
-- answered, else nothing changes and 0 is answered (the hold lapsed and another server took it,
-- or this call ran before). 'done' (delivered, or given up) takes the entry out; 'retry' counts
-- the attempt on the job's record and makes the entry due again after the pause, for any server
-- to take, so a back-off outlives the server that began it; 'back' makes it due at once,
-- uncounted (a server that stops hands back what it has not sent). Safe to run twice: the first
-- run moved or removed the entry, so the second finds it not the caller's. At maxmemory 'done'
-- still runs (its first write is a deletion); the others are refused, and the entry is taken
-- again once its hold lapses.
-- KEYS: 1 outbox
-- ARGV: 1 queue key prefix, 2 member ('ID/TARGET'), 3 fence, 4 'done' | 'retry' | 'back',
--       5 pause (ms, for 'retry')
-- Returns 1 when the entry was the caller's and is settled, 0 when it was not.
--! include lib/record.lua
local outbox = KEYS[1]
local prefix, member, fence, verdict = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local score = redis.call('ZSCORE', outbox, member)
if not score or tonumber(score) ~= fence then return 0 end
if verdict == 'done' then
  redis.call('ZREM', outbox, member)
  return 1
end
local now = now_ms()
if verdict == 'retry' then
  redis.call('ZADD', outbox, 'XX', now + tonumber(ARGV[5]), member)
  local id, target = string.match(member, '^(.*)/(%a+)$')
  local jobkey = job_key(prefix, id)
  if redis.call('EXISTS', jobkey) == 1 then  -- (an expired record is not made again: the next take drops it)
    redis.call('HINCRBY', jobkey, 'notify_tries:' .. target, 1)
  end
else
  redis.call('ZADD', outbox, 'XX', now, member)
end
return 1
