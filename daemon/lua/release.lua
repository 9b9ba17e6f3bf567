-- release: a worker hands back an attempt it stopped before the job finished (a draining worker
-- past its drain timeout, or one told to stop at once).
-- Guarantees: only the job's current attempt, running under this worker, is handed back (the
-- fencing token); otherwise nothing changes and the answer is {'stale', state, attempt}. A
-- handed-back job goes to the front of its queue (`retry`, before every job not yet started) and
-- is claimed next with attempt+1; the hand-back is counted in `handbacks`, so it does not count
-- as a lost attempt towards max_attempts. A job the user cancelled meanwhile becomes cancelled.
-- KEYS: 1 stream, 2 retry, 3 leases, 4 events
-- ARGV: 1 queue key prefix, 2 group, 3 consumer, 4 job id, 5 attempt, 6 retention (s)
-- Returns {'queued'} | {'cancelled'} | {'stale', state, attempt}.
local stream, retry, leases, events = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local prefix, group, consumer, id = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local jobkey = prefix .. 'job:' .. id
local j = redis.call('HMGET', jobkey, 'state', 'attempt', 'worker', 'cancel')
if j[1] ~= 'running' or j[2] ~= ARGV[5] or j[3] ~= consumer then
  return {'stale', j[1] or 'missing', j[2] or '0'}
end
local now = now_ms()
redis.call('ZREM', leases, id)
close_attempt(jobkey, 'released', now)
if j[4] == '1' then
  finish(stream, group, events, jobkey, id, 'cancelled', now, tonumber(ARGV[6]))
  return {'cancelled'}
end
redis.call('HINCRBY', jobkey, 'handbacks', 1)
requeue(stream, group, retry, jobkey, id)
wake(stream)
return {'queued'}
