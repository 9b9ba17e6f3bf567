-- ready: a job whose dependencies are met (daemon/after.py; the server judges) joins its queue at
-- its tail, or, in an array with a window, takes its turn for a place in it (_lib.lua `admit`).
-- Guarantees: only a job still held in `waiting` and still queued moves, once: its stream entry
-- is added (and its place in `prio`, with a priority), so workers see it as any new job; a job
-- cancelled meanwhile, or moved already, is left as it is. Safe to run twice. At maxmemory refused
-- whole (its first write, the entry or the turn, allocates).
-- KEYS: 1 the job's record
-- ARGV: 1 queue key prefix, 2 job id
-- Returns 1 when the job joined its queue, 2 when it waits for a place in its array's window,
-- 0 when it was not waiting (any more), or its dependencies were met already.
local jobkey = KEYS[1]
local prefix, id = ARGV[1], ARGV[2]
local j = redis.call('HMGET', jobkey, 'state', 'priority', 'seq', 'array', 'array_pos', 'window', 'met')
if j[1] ~= 'queued' or j[7] or not redis.call('ZSCORE', prefix .. 'waiting', id) then return 0 end
local window = tonumber(j[6]) or 0
if window > 0 and j[4] and j[4] ~= '' then
  redis.call('ZADD', array_key(prefix, j[4]) .. ':next', tonumber(j[5]) or 0, id)
  redis.call('HSET', jobkey, 'met', '1')
  admit(prefix, j[4], window)
  return redis.call('ZSCORE', prefix .. 'waiting', id) and 2 or 1
end
join(prefix, jobkey, id, tonumber(j[2]) or 0, tonumber(j[3]))
return 1
