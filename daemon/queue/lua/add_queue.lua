-- add_queue: name a queue in the pool's queue set (the reaper, `wait`, metrics and `ls` read it).
-- Sent with every enqueue, in the same round trip: the set has its own hash tag, so it cannot be
-- written by the enqueue script itself, and a write that was lost is made good by the next
-- enqueue rather than never (no cache decides that a queue is known). Safe to run twice.
-- KEYS: 1 queues (set)
-- ARGV: queue names
return redis.call('SADD', KEYS[1], unpack(ARGV))
