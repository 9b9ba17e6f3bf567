-- heartbeat: a worker says it is alive, and what it is, in one call.
-- Guarantees: the worker's registration and its last-seen time change together, and the time is
-- Redis server time (TIME), so how long a worker has been silent is judged on one clock, never by
-- comparing the clocks of different machines. The queues it serves are (re)added to the pool's
-- queue set on every beat, so a lost write to that set never hides a queue that has leases from
-- the reaper. All keys carry the {pool} tag (one Cluster slot). Safe to run twice; at maxmemory
-- refused whole (its first write allocates), and the worker then stops claiming.
-- KEYS: 1 workers (hash), 2 workers:seen (zset), 3 queues (set)
-- ARGV: 1 worker id, 2 registration (msgpack, opaque here), 3.. the queues it serves
-- Returns the Redis server time of the heartbeat (ms).
--! include lib/record.lua
local now = now_ms()
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], now, ARGV[1])
if #ARGV > 2 then redis.call('SADD', KEYS[3], unpack(ARGV, 3)) end
return now
