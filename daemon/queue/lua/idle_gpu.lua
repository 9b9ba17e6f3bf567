-- idle_gpu: record on a job that its attempt leaves its GPUs idle (worker/idle_gpus.py).
-- Guarantees: recorded only while the attempt holds the job (the fence: running, this attempt,
-- this worker, this lease id), so an attempt the pool took back never marks the job another now
-- runs. The record is the worker's (JSON, opaque here), written whole: a second call replaces the
-- first (the flag, then what the queue's policy did). Safe to run twice. At maxmemory it is
-- refused whole (its one write may allocate): the job runs on unflagged.
-- KEYS: 1 the job's record
-- ARGV: 1 worker, 2 attempt, 3 lease id, 4 the record (JSON)
-- Returns 1 when recorded, 0 when the attempt no longer holds the job.
--! include lib/record.lua
local jobkey = KEYS[1]
local j = redis.call('HMGET', jobkey, 'state', 'attempt', 'worker', 'lease')
if not holds(j, ARGV[2], ARGV[1], ARGV[3]) then
  return 0
end
redis.call('HSET', jobkey, 'idle_gpu', ARGV[4])
return 1
