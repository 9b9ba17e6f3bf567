-- renew: extend every lease one worker holds in one queue, in one call.
-- Guarantees: a lease is extended only while it is the job's current one and this worker's own
-- (job running, same attempt, same worker, same lease id, lease present). A lease that was
-- reclaimed, or a job that ended, is never taken back: its answer is 'lost' and nothing changes.
-- 'cancel' means the lease holds but the user asked to stop the job; 'requeue' that the user asked
-- for it to be stopped and handed back (requeue.lua); 'preempt' the same, asked by a job of
-- higher priority that needs its GPUs (claim.lua). Safe to run twice (a renewal
-- again only moves the deadline again). At maxmemory it still runs: moving the deadline of a lease
-- that exists takes no memory, so running jobs keep their leases while nothing new is granted
-- (its first write is a deletion of nothing, on purpose: see _lib.lua).
-- KEYS: 1 leases
-- ARGV: 1 queue key prefix, 2 consumer, 3 lease duration (ms), then triples of job id, attempt,
--       lease id
-- Returns one of 'ok' | 'cancel' | 'requeue' | 'preempt' | 'lost' per triple, in order.
--! include lib/record.lua
local leases = KEYS[1]
local prefix, consumer, lease_ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
local deadline = now_ms() + lease_ms
local out = {}
redis.call('ZREM', leases, '')  -- no lease is named '': a write that frees, so the ones below pass
for i = 4, #ARGV, 3 do
  local id, attempt, lease = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local j = redis.call('HMGET', job_key(prefix, id), 'state', 'attempt', 'worker', 'lease', 'cancel', 'requeue')
  if holds(j, attempt, consumer, lease) and redis.call('ZSCORE', leases, id) then
    redis.call('ZADD', leases, 'XX', deadline, id)
    out[#out + 1] = (j[5] == '1') and 'cancel' or (j[6] == '1') and 'requeue' or (j[6] == 'preempt') and 'preempt'
      or 'ok'
  else
    out[#out + 1] = 'lost'
  end
end
return out
