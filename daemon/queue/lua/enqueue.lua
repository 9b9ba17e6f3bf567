-- enqueue: add one job at the tail of its queue.
-- Guarantees: the job record, its stream entry and its index entry are written together (a script
-- runs atomically); an idempotency key that was used before returns the first job's id and writes
-- nothing; an id that exists already is refused with ID_TAKEN and writes nothing, unless it is this
-- very call run again (same id, same spec: its reply was lost), which answers as the first run did.
-- At maxmemory refused whole (its first write allocates).
-- KEYS: 1 stream, 2 jobs index, 3 seq counter, 4 job hash, 5 idempotency key (optional)
-- ARGV: 1 group, 2 job id, 3 spec (msgpack, opaque here), 4 GPUs wanted, 5 max attempts, 6 retries
-- Returns {job id, 1} when created, {first job id, 0} for a known idempotency key.
local stream, index, seqkey, jobkey, idem = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local group, id = ARGV[1], ARGV[2]
if idem then
  local existing = redis.call('GET', idem)
  if existing then return {existing, existing == id and 1 or 0} end
end
if redis.call('EXISTS', jobkey) == 1 then
  if redis.call('HGET', jobkey, 'spec') == ARGV[3] then return {id, 1} end
  return redis.error_reply('ID_TAKEN job id exists')
end
local seq = reserve(stream, seqkey, group, 1)
add_job(stream, index, jobkey, id, seq, now_ms(), ARGV[3], ARGV[4], ARGV[5], ARGV[6])
if idem then
  redis.call('SET', idem, id)
  redis.call('HSET', jobkey, 'idem', idem)
end
return {id, 1}
