-- requeue: ask that a running job go back to the front of its queue (poolctl requeue).
-- Guarantees: only a running job is flagged; its worker learns it on its next renewal (renew.lua
-- answers 'requeue'), stops the job's processes (SIGTERM, then SIGKILL after its grace) and hands
-- the attempt back (hand_back.lua), which clears the flag: the job is claimed next, before every job
-- that has not started, under the same id with attempt + 1, and counts no loss. A job being
-- cancelled stays cancelled. Safe to run twice (the flag is set again). At maxmemory it still
-- runs: its first write frees (a deletion of nothing, as renew's), and setting the flag of an
-- existing record is how a job is stopped.
-- KEYS: 1 the job's record, 2 leases (the queue's; written first, see above)
-- ARGV: none
-- Returns 'requeueing' | 'cancelling' | the job's state when it is not running | 'missing'.
local jobkey = KEYS[1]
local j = redis.call('HMGET', jobkey, 'state', 'cancel')
if not j[1] then return 'missing' end
if j[1] ~= 'running' then return j[1] end
if j[2] == '1' then return 'cancelling' end
redis.call('ZREM', KEYS[2], '')  -- no lease is named '': a write that frees, so the next one passes
redis.call('HSET', jobkey, 'requeue', '1')
return 'requeueing'
