-- started: a job its worker claimed ahead of a free slot (claim.lua ARGV 20, worker/fast_path.py) has
-- started there now.
-- Guarantees: only the job's current lease, under this worker, is marked (the fence), once. Until
-- this mark an attempt claimed ahead counts as never started: taken back from a dead or frozen
-- worker it is a hand-back, not a loss (reclaim.lua), and fair share bills none of its hold
-- (lib/use.lua `charge`). From it, the attempt counts as run, and fair share bills it from now (the
-- record's 'ran_from'; its 'started_at' stays the claim's, the time FIFO is judged by). Safe to
-- run twice (the second finds no mark to take). At maxmemory it still runs: its first write is a
-- deletion.
-- KEYS: 1 the job's record
-- ARGV: 1 worker, 2 attempt, 3 lease id
-- Returns 1 when the mark was taken now, 0 otherwise.
--! include lib/record.lua
local jobkey = KEYS[1]
local j = redis.call('HMGET', jobkey, 'state', 'attempt', 'worker', 'lease', 'ahead')
if not holds(j, ARGV[2], ARGV[1], ARGV[3]) or j[5] ~= '1' then return 0 end
redis.call('HDEL', jobkey, 'ahead')
redis.call('HSET', jobkey, 'ran_from', now_ms())
return 1
