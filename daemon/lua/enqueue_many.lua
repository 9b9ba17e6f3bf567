-- enqueue_many: add several jobs of one queue at its tail, in order, in one call.
-- Guarantees: each job's record, stream entry and index entry are written, in the order given
-- (their sequence numbers rise in that order, so FIFO holds within the batch, and the batch is
-- never split); an id that exists already (two drawn in the same millisecond) is made unique
-- here by a suffix rather than refused, so a collision never reorders the batch.
-- KEYS: 1 stream, 2 jobs index, 3 seq counter, 4.. one job hash per job (as proposed)
-- ARGV: 1 group, 2 queue key prefix, then 5 per job: job id, spec (msgpack), GPUs wanted,
--       max attempts, retries
-- Returns the jobs' ids, in order.
local stream, index, seqkey, group, prefix = KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2]
local n, now, ids = #KEYS - 3, now_ms(), {}
local first = reserve(stream, seqkey, group, n)
for i = 1, n do
  local a = 3 + (i - 1) * 5
  local id, jobkey, k = ARGV[a], KEYS[3 + i], 0
  while redis.call('EXISTS', jobkey) == 1 do
    k = k + 1
    id = ARGV[a] .. 'z' .. k
    jobkey = prefix .. 'job:' .. id
  end
  add_job(stream, index, jobkey, id, first + i - 1, now,
    ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4])
  ids[i] = id
end
return ids
