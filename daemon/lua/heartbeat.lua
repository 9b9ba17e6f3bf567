-- heartbeat: a worker says it is alive, and what it is, in one call.
-- Guarantees: the worker's registration and its last-seen time change together, and the time is
-- Redis server time (TIME), so how long a worker has been silent is judged on one clock, never by
-- comparing the clocks of different machines. Both keys carry the {pool} tag (one Cluster slot).
-- KEYS: 1 workers (hash), 2 workers:seen (zset)
-- ARGV: 1 worker id, 2 registration (msgpack, opaque here)
-- Returns the Redis server time of the heartbeat (ms).
local now = now_ms()
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], now, ARGV[1])
return now
