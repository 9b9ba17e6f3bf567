-- prune_workers: forget the workers silent for longer than the retention (crashed ones: a worker
-- that stops cleanly unregisters itself), so the registry, read on every scrape and every
-- `poolctl workers`, stays the size of the pool. A worker that beats again registers anew.
-- Guarantees: a worker's record and its last-seen time go together. Safe to run twice.
-- KEYS: 1 workers (hash), 2 workers:seen (zset)
-- ARGV: 1 retention (ms)
-- Returns the ids forgotten.
--! include lib/record.lua
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now_ms() - tonumber(ARGV[1]), 'LIMIT', 0, 100)
if #old > 0 then
  redis.call('HDEL', KEYS[1], unpack(old))
  redis.call('ZREM', KEYS[2], unpack(old))
end
return old
