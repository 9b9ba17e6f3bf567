-- outbox_take: take job ends of one queue's outbox on, to notify them (server/notifier.py).
-- Guarantees: an entry ('ID/TARGET', put there by the end of its job: to_outbox in _lib.lua) is
-- taken only once due: its score (Redis server time, ms) has passed, as it has for an end just
-- put there, for a retry whose pause is over, and for an entry whose last taker let its hold
-- lapse (a server killed in the middle of a delivery). Taking it makes its score now + the hold:
-- no other take sees it until then, so one server sends it, and that score is the taker's fence
-- (outbox_settle.lua changes the entry only for it). An entry whose job's record has expired
-- (job_retention after the end: nothing is left to send) is dropped and counted. Run twice, it
-- takes nothing twice (what the first run took is not due). At maxmemory refused whole (its
-- first write allocates): the ends wait in the outbox until Redis has room again.
-- KEYS: 1 outbox, 2 outbox_dropped (how many ends the outbox's cap pushed out)
-- ARGV: 1 queue key prefix, 2 hold (ms), 3 most to take, 4... job ids whose entries to take, if
--       due (the ends a server just saw); none: the entries due longest ago (a sweep), and the
--       count of those the cap pushed out, handed to this sweep alone (the counter is reset)
-- Returns {pushed out, expired, ms until the first entry left is due (0: now; -1: none left),
-- then per entry taken: member, fence, attempts made before}.
--! include lib/record.lua
--! include lib/caps.lua
local outbox, pushed = KEYS[1], KEYS[2]
local prefix, hold, most = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
local due = {}
if #ARGV > 3 then
  for i = 4, #ARGV do
    for _, target in ipairs({'job', 'pool'}) do
      local member = ARGV[i] .. '/' .. target
      local score = redis.call('ZSCORE', outbox, member)
      if score and tonumber(score) <= now then due[#due + 1] = member end
    end
  end
else
  due = redis.call('ZRANGEBYSCORE', outbox, '-inf', now, 'LIMIT', 0, most)
end
local out, expired, fence = {0, 0, -1}, {}, now + hold
for _, member in ipairs(due) do
  local id, target = string.match(member, '^(.*)/(%a+)$')
  local j = id and redis.call('HMGET', job_key(prefix, id), 'state', 'notify_tries:' .. target)
  if not (j and j[1]) then
    expired[#expired + 1] = member
  elseif #out < 3 + 3 * most then
    redis.call('ZADD', outbox, 'XX', fence, member)
    out[#out + 1], out[#out + 2], out[#out + 3] = member, fence, tonumber(j[2]) or 0
  end
end
if #expired > 0 then
  redis.call('ZREM', outbox, unpack(expired))
  out[2] = #expired
end
if #ARGV == 3 then out[1] = tonumber(redis.call('GETDEL', pushed)) or 0 end
local first = redis.call('ZRANGE', outbox, 0, 0, 'WITHSCORES')
if first[2] then out[3] = math.max(0, tonumber(first[2]) - now) end
return out
