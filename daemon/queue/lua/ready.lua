-- ready: the server's judge of a job held for others to end (daemon/after.py): the dependencies it
-- found met are recorded on the job ('after_met'), and once all are, the job joins its queue at its
-- tail, or, in an array with a window, takes its turn for a place in it (lib/arrays.lua `take_turn`).
-- Guarantees: only a job still queued and held in `depends` is written, so a job cancelled or
-- let in meanwhile is left as it is; a dependency recorded as met stays met, so the expiry of its
-- job's record (job_retention after it ended) cannot cancel a job that still waits for another.
-- Let in, the job's stream entry is added (and its place in `prio`, with a priority), so workers
-- see it as any new job, once. Safe to run twice. At maxmemory refused whole (its first write,
-- the record's, allocates).
-- KEYS: 1 the job's record
-- ARGV: 1 queue key prefix, 2 job id, 3 the dependencies found met now ("JOB:how ...", added to
--       those found before), 4 '1' when all it waits for are
-- Returns 1 when the job joined its queue, 2 when it took its turn for its array's window, 0
-- when it was not held for others (any more), or is not ready yet.
--! include lib/arrays.lua
local jobkey = KEYS[1]
local prefix, id, met, all = ARGV[1], ARGV[2], ARGV[3], ARGV[4] == '1'
local j = redis.call('HMGET', jobkey, 'state', 'priority', 'seq', 'array', 'array_pos', 'window')
if j[1] ~= 'queued' or not redis.call('ZSCORE', prefix .. 'depends', id) then return 0 end
local known, seen = {}, {}  -- those found before, then these, each once
for dep in string.gmatch((redis.call('HGET', jobkey, 'after_met') or '') .. ' ' .. met, '%S+') do
  if not seen[dep] then known[#known + 1], seen[dep] = dep, true end
end
redis.call('HSET', jobkey, 'after_met', table.concat(known, ' '))
if not all then return 0 end
redis.call('ZREM', prefix .. 'depends', id)
local window = tonumber(j[6]) or 0
if window > 0 and j[4] and j[4] ~= '' then
  take_turn(prefix, id, j[4], tonumber(j[5]) or 0, window)
  return redis.call('ZSCORE', prefix .. 'waiting', id) and 2 or 1
end
join(prefix, jobkey, id, tonumber(j[2]) or 0, tonumber(j[3]))
return 1
