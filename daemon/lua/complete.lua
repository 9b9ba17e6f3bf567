-- complete: record how an attempt ended, exactly once.
-- Guarantees: the outcome is written only when ARGV's attempt is the job's current attempt and the
-- job is running under this worker (the fencing token); otherwise nothing changes and the answer
-- is {'stale', state, attempt}. When accepted, the lease, the stream entry (acked and deleted),
-- the job's state and its history change together, and a terminal event goes to `events`. A
-- failed attempt with retries left goes back to the front of the queue instead ({'retry'}).
-- KEYS: 1 stream, 2 leases, 3 events, 4 retry
-- ARGV: 1 queue key prefix, 2 group, 3 consumer, 4 job id, 5 attempt, 6 state, 7 exit code ('' if
--       none), 8 detail, 9 result (msgpack, opaque here), 10 retention (s)
local stream, leases, events, retry = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local prefix, group, consumer, id = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local attempt, state = ARGV[5], ARGV[6]
local jobkey = prefix .. 'job:' .. id
local j = redis.call('HMGET', jobkey, 'state', 'attempt', 'worker', 'failures', 'retries', 'cancel')
if j[1] ~= 'running' or j[2] ~= attempt or j[3] ~= consumer then
  return {'stale', j[1] or 'missing', j[2] or '0'}
end
local now = now_ms()
redis.call('ZREM', leases, id)
redis.call('HSET', jobkey, 'exit_code', ARGV[7], 'detail', ARGV[8], 'result', ARGV[9])
close_attempt(jobkey, state, now)
if state == 'failed' and j[6] ~= '1' and tonumber(j[4]) < tonumber(j[5]) then
  redis.call('HINCRBY', jobkey, 'failures', 1)
  requeue(stream, group, retry, jobkey, id)
  wake(stream)
  return {'retry'}
end
finish(stream, group, events, jobkey, id, state, now, tonumber(ARGV[10]))
return {'ok'}
