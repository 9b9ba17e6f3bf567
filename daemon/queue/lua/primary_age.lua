-- primary_age: how long the redis-server running this script has been the pool's Redis, as far as
-- the pool knows.
-- Guarantees: a redis-server other than the one the record names (it restarted, or a replica was
-- promoted in a failover: a new run id either way, read here from the server itself) is recorded
-- as the pool's from now, atomically, and answered 0; later callers get the time since. A Redis
-- with no record at all has never held the pool's data (or has lost all of it, leases included):
-- nothing it could have forgotten is running, so it is recorded as the pool's since always. The
-- record is replicated like any write, so a failover that loses it, or carries an older one over,
-- makes the answer smaller (a longer pause, claim_gate.py), the safe side.
-- At maxmemory refused whole (its first write allocates): the caller then takes the age as 0.
-- KEYS: 1 the record (hash: run_id, since)
-- Returns the age in ms.
--! include lib/record.lua
local run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%w+)')
local now = now_ms()
local seen = redis.call('HMGET', KEYS[1], 'run_id', 'since')
if not seen[1] then
  redis.call('HSET', KEYS[1], 'run_id', run_id, 'since', 0)
  return now
end
if seen[1] ~= run_id or not seen[2] then
  redis.call('HSET', KEYS[1], 'run_id', run_id, 'since', now)
  return 0
end
return math.max(0, now - tonumber(seen[2]))
