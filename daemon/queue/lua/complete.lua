-- complete: record how an attempt ended, exactly once.
-- Guarantees: the outcome is written only when ARGV's lease is the job's current one (the job is
-- running this attempt under this worker with this lease id: the fencing token); otherwise
-- nothing changes and the answer is {'stale', state, attempt}. When accepted, the lease, the stream
-- entry (acked and deleted), the job's state and its history change together, and a terminal event
-- goes to `events`. A failed attempt with retries left goes back to the front of the queue instead
-- (queued), after its back-off (ARGV 12, 13; lib/front.lua `retry_after`); retries are counted in
-- `failures`, apart from losses. The same call again (its reply
-- was lost), or any later complete of this lease, answers as the first did and changes nothing. At maxmemory it still runs (its first
-- write is a deletion): recording outcomes is how the pool frees memory.
-- KEYS: 1 stream, 2 leases, 3 events, 4 the front
-- ARGV: 1 queue key prefix, 2 group, 3 consumer, 4 job id, 5 attempt, 6 lease id, 7 state,
--       8 exit code ('' if none), 9 detail, 10 result (msgpack, opaque here), 11 retention (s),
--       12 a retry's back-off (ms; 0: none) before its failure count doubles it, 13 its most (ms),
--       14 days the job's accounting record is kept (lib/account.lua; absent: its default),
--       15 the attempt's mean GPU utilisation in percent, as its worker measured it ('' or
--       absent: not measured; lib/account.lua)
-- Returns {state afterwards} (the outcome's, or 'queued' for a retry) | {'stale', state, attempt}.
--! include lib/record.lua
--! include lib/use.lua
--! include lib/finish.lua
--! include lib/front.lua
local stream, leases, events, front = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local prefix, group, consumer, id = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local attempt, lease, state = ARGV[5], ARGV[6], ARGV[7]
local jobkey = job_key(prefix, id)
local j = redis.call('HMGET', jobkey, 'state', 'attempt', 'worker', 'lease', 'failures', 'retries', 'cancel',
  'ended_by', 'ended_as', unpack(FINISH_FIELDS))
if j[8] == lease then return {j[9]} end  -- this lease ended already: as it did then
if not holds(j, attempt, consumer, lease) then
  return {'stale', j[1] or 'missing', j[2] or '0'}
end
local now = now_ms()
redis.call('ZREM', leases, id)
redis.call('HDEL', jobkey, 'ahead')  -- it ran, whether or not its start's mark came first
close_attempt(prefix, jobkey, state, now, tonumber(ARGV[15]))
local outcome = {'exit_code', ARGV[8], 'detail', ARGV[9], 'result', ARGV[10], 'ended_by', lease}
if state == 'failed' and j[7] ~= '1' and tonumber(j[5]) < tonumber(j[6]) then
  outcome[#outcome + 1], outcome[#outcome + 2] = 'ended_as', 'queued'
  redis.call('HSET', jobkey, unpack(outcome))
  local failures = redis.call('HINCRBY', jobkey, 'failures', 1)
  retry_after(prefix, stream, group, front, id, failures, tonumber(ARGV[12]) or 0, tonumber(ARGV[13]) or 0, now)
  return {'queued'}
end
outcome[#outcome + 1], outcome[#outcome + 2] = 'ended_as', state
finish(prefix, stream, group, events, id, state, now, tonumber(ARGV[11]), {unpack(j, 10, 17)}, outcome, ARGV[14])
return {state}
