-- enqueue_many: add several jobs of one queue at its tail, in order, in one call.
-- Guarantees: each job's record, stream entry and index entry are written, in the order given
-- (their sequence numbers rise in that order, so FIFO holds within the batch, and the batch is
-- never split); an id that exists already (two drawn in the same millisecond) is made unique
-- where it was drawn (free_job_id), so a collision never reorders the batch. The call run
-- again (its reply was lost) finds its batch key and answers the ids of its first run, adding
-- nothing; the batch key lives BATCH_SECONDS. At maxmemory refused whole (its first write allocates).
-- KEYS: 1 stream, 2 jobs index, 3 seq counter, 4 the batch key (named by a random id per call),
--       5.. one job hash per job (as proposed)
-- ARGV: 1 group, 2 queue key prefix, then 10 per job: job id, spec (msgpack), GPUs wanted,
--       max attempts, retries, priority, user, MiB on a shared GPU, '1' when it waits for others,
--       where its end is notified (enqueue.lua's ARGV[12])
-- Returns the jobs' ids, in order.
local BATCH_SECONDS = 600
local stream, index, seqkey, batch = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local group, prefix = ARGV[1], ARGV[2]
local done = redis.call('GET', batch)
if done then return cjson.decode(done) end
local n, now, ids = #KEYS - 4, now_ms(), {}
local first = reserve(stream, seqkey, group, n)
for i = 1, n do
  local a = 3 + (i - 1) * 10
  local free = free_job_id(prefix, ARGV[a])  -- no spec: the batch key recognises a call run again
  local id, jobkey = free[1], free[2]
  add_job(stream, index, jobkey, id, first + i - 1, now,
    ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], prefix, ARGV[a + 5], ARGV[a + 6], ARGV[a + 7],
    ARGV[a + 8])
  if ARGV[a + 9] ~= '' then redis.call('HSET', jobkey, 'notify', ARGV[a + 9]) end
  ids[i] = id
end
redis.call('SET', batch, cjson.encode(ids), 'EX', BATCH_SECONDS)
return ids
