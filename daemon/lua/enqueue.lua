-- enqueue: add one job at the tail of its queue.
-- Guarantees: the job record, its stream entry and its index entry are written together (a script
-- runs atomically); an idempotency key that was used before returns the first job's id and writes
-- nothing; an id that exists already is refused with ID_TAKEN and writes nothing.
-- KEYS: 1 stream, 2 jobs index, 3 seq counter, 4 job hash, 5 idempotency key (optional)
-- ARGV: 1 group, 2 job id, 3 spec (msgpack, opaque here), 4 GPUs wanted, 5 max attempts, 6 retries
-- Returns {job id, 1} when created, {first job id, 0} for a known idempotency key.
local stream, index, seqkey, jobkey, idem = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local group, id = ARGV[1], ARGV[2]
if idem then
  local existing = redis.call('GET', idem)
  if existing then return {existing, 0} end
end
if redis.call('EXISTS', jobkey) == 1 then return redis.error_reply('ID_TAKEN job id exists') end
if redis.call('EXISTS', stream) == 0 then
  redis.call('XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM')
end
local seq = redis.call('INCR', seqkey)
local entry = redis.call('XADD', stream, '*', 'job', id)
redis.call('HSET', jobkey, 'id', id, 'state', 'queued', 'seq', seq, 'attempt', 0, 'spec', ARGV[3],
  'gpus', ARGV[4], 'max_attempts', ARGV[5], 'retries', ARGV[6], 'failures', 0,
  'enqueued_at', now_ms(), 'entry', entry)
if idem then
  redis.call('SET', idem, id)
  redis.call('HSET', jobkey, 'idem', idem)
end
redis.call('ZADD', index, seq, id)
return {id, 1}
