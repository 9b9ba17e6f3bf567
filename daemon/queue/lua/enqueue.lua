-- enqueue: add one job at the tail of its queue.
-- Guarantees: the job record, its stream entry and its index entry are written together (a script
-- runs atomically); an idempotency key that was used before returns the first job's id and writes
-- nothing; an id that exists already is made unique (free_job_id), unless it holds this very spec,
-- which is this call run again (its reply was lost) and is answered as the first run was.
-- At maxmemory refused whole (its first write allocates).
-- KEYS: 1 stream, 2 jobs index, 3 seq counter, 4 job hash (as proposed), 5 idempotency key (optional)
-- ARGV: 1 group, 2 queue key prefix, 3 job id, 4 spec (msgpack, opaque here), 5 GPUs wanted,
--       6 max attempts, 7 retries, 8 priority (0: none; else claimed before the stream, _lib.lua),
--       9 the user (whose caps the job counts against, claim.lua), 10 MiB of memory it asks for
--       on one shared GPU (0: whole GPUs), 11 '1' when it waits for other jobs first (held in
--       `waiting` till ready.lua), 12 where its end is notified ('job', 'pool', both
--       space-separated, or '': to_outbox in _lib.lua)
-- Returns {job id, 1} when created, {first job id, 0} for a known idempotency key.
local stream, index, seqkey, idem = KEYS[1], KEYS[2], KEYS[3], KEYS[5]
local group, prefix = ARGV[1], ARGV[2]
local free = free_job_id(prefix, ARGV[3], ARGV[4])
local id, jobkey, ran_before = free[1], free[2], free[3]
if idem then
  local existing = redis.call('GET', idem)
  if existing then return {existing, existing == id and 1 or 0} end
end
if ran_before then return {id, 1} end
local seq = reserve(stream, seqkey, group, 1)
add_job(stream, index, jobkey, id, seq, now_ms(), ARGV[4], ARGV[5], ARGV[6], ARGV[7], prefix, ARGV[8], ARGV[9],
  ARGV[10], ARGV[11])
if ARGV[12] and ARGV[12] ~= '' then redis.call('HSET', jobkey, 'notify', ARGV[12]) end
if idem then
  redis.call('SET', idem, id)
  redis.call('HSET', jobkey, 'idem', idem)
end
return {id, 1}
