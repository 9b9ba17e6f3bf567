-- store: count the bytes a user puts in the pool's Redis, across every queue, and refuse what
-- would take them past their bound (issue 44 item 6). A job's record, once it ends, stays for the
-- retention, so what a user holds is what they submitted over the last retention, whatever
-- became of it: the user's `stored` HASH counts it per day of submission (day number -> bytes,
-- each job's spec and a fixed overhead per record, job_queue.py), and a day counts until every
-- job submitted in it that ended at once has expired (the day's end plus the retention). An
-- over-estimate where it matters: a cancel or an early end gives nothing back; a job still queued
-- past the retention is bounded by its user's count of jobs not ended instead (_lib.lua
-- `unended`). Checked and counted in this one call, so concurrent submissions, in any queues,
-- cannot pass the bound together. A call with a negative count gives that much back to the day
-- it names (a submission counted here that its enqueue then refused, writing nothing), never
-- below 0. Safe to run twice as every script is, in the safe direction: a count sent again after
-- its reply was lost counts twice (an over-estimate, for the retention); a give-back sent again
-- gives back twice, which only a submission refused after a lost reply can do.
-- KEYS: 1 the user's stored hash (keys.stored)
-- ARGV: 1 bytes to add (negative: to give back), 2 the most the user may hold, 3 retention (s),
--       4 the day to give back to (with a negative count)
-- Returns {'ok', day counted in} or {'over', bytes held, when room comes back (s since the
-- epoch; 0: never, the submission alone is larger than the bound)}.
--! include lib/record.lua
local DAY = 86400
local key, adding, most, retention = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if adding < 0 then
  -- Given back at maxmemory too, where a refused enqueue's give-back usually runs: it allocates
  -- nothing, and Redis refuses a script's command for memory only until its first write, so the
  -- day's count is taken out (HDEL, never refused for memory) and put back lowered.
  local held = tonumber(redis.call('HGET', key, ARGV[4]))
  if held ~= nil then
    redis.call('HDEL', key, ARGV[4])
    redis.call('HSET', key, ARGV[4], math.max(held + adding, 0))
  end
  return {'ok', ARGV[4]}
end
local now = now_ms() / 1000
local today, oldest = math.floor(now / DAY), math.floor((now - retention) / DAY)
local held, first = 0, nil
local days = redis.call('HGETALL', key)
for i = 1, #days, 2 do
  local day = tonumber(days[i])
  if day < oldest then
    redis.call('HDEL', key, days[i])  -- every record of that day's has expired
  else
    held = held + tonumber(days[i + 1])
    if first == nil or day < first then first = day end
  end
end
if held + adding > most then
  if adding > most or first == nil then return {'over', held, 0} end
  return {'over', held, (first + 1) * DAY + retention}
end
redis.call('HINCRBY', key, today, adding)
redis.call('EXPIRE', key, retention + DAY)
return {'ok', tostring(today)}
