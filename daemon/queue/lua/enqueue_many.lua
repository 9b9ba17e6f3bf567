-- enqueue_many: add several jobs of one queue at its tail, in order, in one call.
-- Guarantees: each job's record, stream entry and index entry are written, with what it waits
-- for and its place in its array (add_job), in the order given (their sequence numbers rise in
-- that order, so FIFO holds within the batch, and the batch is never split); an id that exists
-- already (two drawn in the same millisecond) is made unique where it was drawn (free_job_id), so
-- a collision never reorders the batch. The call run again (its reply was lost) finds its batch
-- key and answers the ids of its first run, adding nothing; the batch key lives BATCH_SECONDS. A
-- call that would take one of its users past the most jobs they may have in the queue not ended
-- (ARGV 3; lib/finish.lua `unended`) is refused whole, writing nothing, in this same call; the first
-- call of a larger batch in this queue is also given the jobs of the batch's later calls here
-- (ARGV 4), so it judges the whole batch, and a refused call marks the batch refused (KEYS 5),
-- so its later calls here refuse too and none of the batch is written (job_queue.py
-- enqueue_many). At maxmemory refused whole (its first write allocates).
-- KEYS: 1 stream, 2 jobs index, 3 seq counter, 4 the batch key (named by a random id per call),
--       5 the batch's refused mark (named by a random id per batch), 6.. one job hash per job
--       (as proposed)
-- ARGV: 1 group, 2 queue key prefix, 3 the most jobs one user may have not ended here ('': no
--       bound), 4 the batch's jobs here in later calls (JSON: user -> how many; '': none), then
--       per job its proposed id and the job (lib/enqueue.lua JOB_ARGS)
-- Returns the jobs' ids, in order; {'over', user, how many they have} when refused.
--! include lib/record.lua
--! include lib/finish.lua
--! include lib/enqueue.lua
local BATCH_SECONDS = 600
local stream, index, seqkey, batch, refused = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local group, prefix, most = ARGV[1], ARGV[2], tonumber(ARGV[3])
local done = redis.call('GET', batch)
if done then return cjson.decode(done) end
local n, now, ids = #KEYS - 5, now_ms(), {}
local per_job = 1 + #JOB_ARGS
if most then
  local over = redis.call('GET', refused)
  if over then return cjson.decode(over) end
  local adding = ARGV[4] ~= '' and cjson.decode(ARGV[4]) or {}  -- user -> jobs of theirs in the batch
  for i = 1, n do
    local user = job_args(ARGV, 6 + (i - 1) * per_job).user or ''
    adding[user] = (adding[user] or 0) + 1
  end
  for user, k in pairs(adding) do
    local has = unended(prefix, user)
    if has + k > most then
      redis.call('SET', refused, cjson.encode({'over', user, has}), 'EX', BATCH_SECONDS)
      return {'over', user, has}
    end
  end
end
local first = reserve(stream, seqkey, group, n)
for i = 1, n do
  local a = 5 + (i - 1) * per_job
  local free = free_job_id(prefix, ARGV[a])  -- no spec: the batch key recognises a call run again
  local id, jobkey = free[1], free[2]
  add_job(prefix, index, jobkey, id, first + i - 1, now, job_args(ARGV, a + 1))
  ids[i] = id
end
redis.call('SET', batch, cjson.encode(ids), 'EX', BATCH_SECONDS)
return ids
