-- checkpoint: record an attempt's complete checkpoint save as the one a later attempt restores.
-- Guarantees: recorded only while the attempt holds the job (the fence: running, this attempt,
-- this worker, this lease id) and its lease has not expired. A save by an attempt the pool has
-- taken back, or may take back at any moment (stopped or cut off past its deadline; another
-- attempt may hold the job by now), is never recorded, so never restored: a later attempt starts
-- from what the attempt that held the job saved, never from a save made behind its back. Safe to
-- run twice (the same save recorded again). At maxmemory it is refused whole (its one write may
-- allocate): the save recorded before stays the one restored.
-- KEYS: 1 the job's record, 2 the queue's leases
-- ARGV: 1 worker, 2 attempt, 3 lease id, 4 the save's name (checkpoints.py: NAME.N)
-- Returns 1 when recorded, 0 when the attempt no longer holds the job.
--! include lib/record.lua
local jobkey, leases = KEYS[1], KEYS[2]
local j = redis.call('HMGET', jobkey, 'state', 'attempt', 'worker', 'lease', 'id')
local deadline = j[5] and redis.call('ZSCORE', leases, j[5])
if not holds(j, ARGV[2], ARGV[1], ARGV[3]) or not deadline or tonumber(deadline) <= now_ms() then
  return 0
end
redis.call('HSET', jobkey, 'checkpoint', ARGV[4])
return 1
