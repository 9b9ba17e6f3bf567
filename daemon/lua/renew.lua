-- renew: extend every lease one worker holds in one queue, in one call.
-- Guarantees: a lease is extended only while its attempt is current and this worker's own (job
-- running, same attempt, same worker, lease present). A lease that was reclaimed, or a job that
-- ended, is never taken back: its answer is 'lost' and nothing changes. 'cancel' means the lease
-- holds but the user asked to stop the job.
-- KEYS: 1 leases
-- ARGV: 1 queue key prefix, 2 consumer, 3 lease duration (ms), then pairs of job id, attempt
-- Returns one of 'ok' | 'cancel' | 'lost' per pair, in order.
local leases = KEYS[1]
local prefix, consumer, lease_ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
local deadline = now_ms() + lease_ms
local out = {}
for i = 4, #ARGV, 2 do
  local id, attempt = ARGV[i], ARGV[i + 1]
  local j = redis.call('HMGET', prefix .. 'job:' .. id, 'state', 'attempt', 'worker', 'cancel')
  if j[1] == 'running' and j[2] == attempt and j[3] == consumer and redis.call('ZSCORE', leases, id) then
    redis.call('ZADD', leases, 'XX', deadline, id)
    out[#out + 1] = (j[4] == '1') and 'cancel' or 'ok'
  else
    out[#out + 1] = 'lost'
  end
end
return out
