-- hand_back: a worker hands back an attempt it stopped before the job finished (a draining worker
-- past its drain timeout, one told to stop at once, or one that claimed a job it cannot start).
-- Guarantees: only the job's current lease, running under this worker, is handed back (the
-- fencing token); otherwise nothing changes and the answer is {'stale', state, attempt}. A
-- handed-back job goes to the front of its queue (before every job not yet started) and
-- is claimed next with attempt+1; the hand-back is counted in `handbacks`, never as a loss
-- towards max_attempts, unless the pool's GPU policies made it (ARGV 9: a job left idle, or on a
-- GPU with a fault; or a worker that could not set its slot's CPU and memory limits): that one is
-- a loss, and once `losses` reaches max_attempts the job is dead (a job that idles, or faults its
-- GPU, or meets workers that cannot hold it to its limits, never goes round for ever). A job the
-- user cancelled meanwhile becomes cancelled. The same call again answers as the first did. At
-- maxmemory it still runs (its first write is a deletion).
-- KEYS: 1 stream, 2 the front, 3 leases, 4 events
-- ARGV: 1 queue key prefix, 2 group, 3 consumer, 4 job id, 5 attempt, 6 lease id, 7 retention (s),
--       8 days the job's accounting record is kept (lib/account.lua; absent: its default),
--       9 '1' when the pool's GPU policies hand it back, or a worker that could not set its limits
--         (absent or '': a drain, a requeue),
--       10 the attempt's mean GPU utilisation in percent, as its worker measured it ('' or absent:
--         not measured; lib/account.lua), as complete.lua takes it: the GPU-ms a handed-back
--         attempt held are counted, so their measurement is too,
--       11 why the pool's policies handed it back (ARGV 9), the job's `detail` until an end of
--         its own sets another (while it waits, and while its next attempt runs, as a failed
--         retry's detail is), and named in a dead job's (absent or '': the detail stays)
-- Returns {'queued'} | {'cancelled'} | {'dead'} | {'stale', state, attempt}.
--! include lib/record.lua
--! include lib/use.lua
--! include lib/finish.lua
--! include lib/front.lua
local stream, front, leases, events = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local prefix, group, consumer, id, lease = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[6]
local jobkey = job_key(prefix, id)
local j = redis.call('HMGET', jobkey, 'state', 'attempt', 'worker', 'lease', 'cancel', 'ended_by', 'ended_as',
  'max_attempts')
if j[6] == lease then return {j[7]} end  -- this lease ended already: as it did then
if not holds(j, ARGV[5], consumer, lease) then
  return {'stale', j[1] or 'missing', j[2] or '0'}
end
local now = now_ms()
redis.call('ZREM', leases, id)
close_attempt(prefix, jobkey, 'released', now, tonumber(ARGV[10]))
redis.call('HDEL', jobkey, 'ahead')  -- (charged nothing above, if it never started)
local answer = 'queued'
local losses = ARGV[9] == '1' and redis.call('HINCRBY', jobkey, 'losses', 1) or 0
if j[5] == '1' then
  finish(prefix, stream, group, events, id, 'cancelled', now, tonumber(ARGV[7]), nil, nil, ARGV[8])
  answer = 'cancelled'
elseif losses > 0 and losses >= tonumber(j[8]) then
  local last = (ARGV[11] or '') ~= '' and ('; the last: ' .. ARGV[11]) or ''
  redis.call('HSET', jobkey, 'detail',
    'handed back by the pool\'s GPU policies (idle GPUs, a GPU fault) or by workers that could not set '
    .. 'its CPU and memory limits: ' .. losses .. ' attempts lost (max_attempts)' .. last)
  finish(prefix, stream, group, events, id, 'dead', now, tonumber(ARGV[7]), nil, nil, ARGV[8])
  answer = 'dead'
else
  redis.call('HINCRBY', jobkey, 'handbacks', 1)
  if (ARGV[11] or '') ~= '' then redis.call('HSET', jobkey, 'detail', ARGV[11]) end
  requeue(prefix, stream, group, front, id)
end
redis.call('HSET', jobkey, 'ended_by', lease, 'ended_as', answer)
return {answer}
