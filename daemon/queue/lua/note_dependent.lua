-- note_dependent: job ARGV[1] waits for the job whose `dependents` set is KEYS[1] (daemon/after.py),
-- so that the end of that job brings the server to judge it at once (its sweep would, later).
-- Guarantees: the waiting job is in the set, which lives as long as the job waited for does: no
-- expiry while it has not ended (finish, _lib.lua, sets the retention when it ends), or the time
-- its record has left once it has. Safe to run twice. At maxmemory refused (SADD allocates; the
-- reads before it write nothing).
-- KEYS: 1 the dependents set of the job waited for, 2 that job's record
-- ARGV: 1 the waiting job's id
-- Returns 1, or 0 when the job waited for is not in the pool (any more).
local left = redis.call('PTTL', KEYS[2])
if left == -2 then return 0 end  -- gone: the judge cancels the job that waited for it
redis.call('SADD', KEYS[1], ARGV[1])
if left > 0 then
  redis.call('PEXPIRE', KEYS[1], left)
else
  redis.call('PERSIST', KEYS[1])
end
return 1
