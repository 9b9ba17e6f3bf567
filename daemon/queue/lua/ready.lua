-- ready: a job that waited for others to end (daemon/after.py) joins its queue, at its tail.
-- Guarantees: only a job still held in `waiting` and still queued moves, once: its stream entry
-- is added (and its place in `prio`, with a priority), so workers see it as any new job; a job
-- cancelled meanwhile, or moved already, is left as it is. Safe to run twice. At maxmemory refused
-- whole (its first write, the entry, allocates).
-- KEYS: 1 stream, 2 the job's record
-- ARGV: 1 queue key prefix, 2 job id
-- Returns 1 when the job joined its queue, 0 when it was not waiting (any more).
local stream, jobkey = KEYS[1], KEYS[2]
local prefix, id = ARGV[1], ARGV[2]
local j = redis.call('HMGET', jobkey, 'state', 'priority', 'seq')
if j[1] ~= 'queued' or not redis.call('ZSCORE', prefix .. 'waiting', id) then return 0 end
local entry = redis.call('XADD', stream, '*', 'job', id)
redis.call('ZREM', prefix .. 'waiting', id)
redis.call('HSET', jobkey, 'entry', entry)
local priority = tonumber(j[2]) or 0
if priority > 0 then
  redis.call('ZADD', prefix .. 'prio', (PRIO_MAX - priority) * PRIO_SEQ + tonumber(j[3]), id)
end
return 1
