-- enqueue: add one job at the tail of its queue.
-- Guarantees: the job record, its stream entry and its index entry are written together (a script
-- runs atomically), and so is what it waits for and its place in its array (add_job: a job held
-- for others is never without the record of what it waits for); an idempotency key that was used
-- before returns the first job's id and writes nothing, saying whether that job's spec is another
-- (a conflict: the key was reused for another submission); an id that exists already is made unique
-- (free_job_id), unless it holds this very spec, which is this call run again (its reply was lost)
-- and is answered as the first run was. A job that would take its user past the most jobs they
-- may have in the queue not ended (ARGV 3; lib/finish.lua `unended`) is refused, writing nothing, in
-- this same call: concurrent enqueues cannot pass the bound together. At maxmemory refused
-- whole (its first write allocates).
-- KEYS: 1 stream, 2 jobs index, 3 seq counter, 4 job hash (as proposed), 5 idempotency key (optional)
-- ARGV: 1 group, 2 queue key prefix, 3 the most jobs one user may have not ended here ('': no
--       bound), 4 job id, 5.. the job (lib/enqueue.lua JOB_ARGS, its spec first)
-- Returns {job id, 1} when created, {first job id, 0, conflict} for a known idempotency key
-- (conflict: 1 when the first job's spec is not this one, else 0), {'over', how many the user
-- has} when refused.
--! include lib/record.lua
--! include lib/finish.lua
--! include lib/enqueue.lua
local stream, index, seqkey, idem = KEYS[1], KEYS[2], KEYS[3], KEYS[5]
local group, prefix, most = ARGV[1], ARGV[2], tonumber(ARGV[3])
local job = job_args(ARGV, 5)
local free = free_job_id(prefix, ARGV[4], job.spec)
local id, jobkey, ran_before = free[1], free[2], free[3]
if idem then
  local existing = redis.call('GET', idem)
  if existing then
    local same = existing == id or redis.call('HGET', job_key(prefix, existing), 'spec') == job.spec
    return {existing, existing == id and 1 or 0, same and 0 or 1}
  end
end
if ran_before then return {id, 1} end
local has = unended(prefix, job.user or '')
if most and has + 1 > most then return {'over', has} end
local seq = reserve(stream, seqkey, group, 1)
add_job(prefix, index, jobkey, id, seq, now_ms(), job)
if idem then
  redis.call('SET', idem, id)
  redis.call('HSET', jobkey, 'idem', idem)
end
return {id, 1}
