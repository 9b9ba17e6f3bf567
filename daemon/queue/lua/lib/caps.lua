-- lib/caps.lua: jobs held aside at their user's cap.
--! include lib/record.lua

-- Caps per user (claim.lua): a queued job whose user is at a cap is held aside, in the queue's
-- `capped` ZSET and its user's `capped:USER` (both by seq); `capped_users` lists each such user
-- (scored no later than their oldest held job's seq), so a claim finds the oldest held job of a
-- user below the cap with one look per user, however many jobs the others have held.
-- `listed`: the caller knows `user` is in capped_users with a seq no later than this one.
-- `front`: held from the front in a fair-share queue, where the users' lines hold every waiting job:
-- it is also in `capped_front`, marked 'front' on its record, and goes first (claim/front.lua).
local function hold(prefix, user, id, seq, listed, front)
  if front then
    redis.call('ZADD', prefix .. 'capped_front', seq, id)
    redis.call('HSET', job_key(prefix, id), 'front', '1')
  end
  redis.call('ZADD', prefix .. 'capped', seq, id)
  redis.call('ZADD', prefix .. 'capped:' .. user, seq, id)
  if not listed then redis.call('ZADD', prefix .. 'capped_users', 'LT', seq, user) end
end

-- Returns the user's oldest held job left, {id, seq} ({} when none). A user's score in
-- capped_users is left as it was while they hold jobs: no later than their oldest held job's seq,
-- which is all a claim needs of it (it reads each user's line itself), at one write less a start.
local function unhold(prefix, user, id)
  if redis.call('ZREM', prefix .. 'capped', id) == 0 then return {} end
  redis.call('HDEL', job_key(prefix, id), 'front')  -- (claim/front.lua: held from the front)
  redis.call('ZREM', prefix .. 'capped_front', id)
  local mine = prefix .. 'capped:' .. user
  redis.call('ZREM', mine, id)
  local top = redis.call('ZRANGE', mine, 0, 0, 'WITHSCORES')
  if not top[1] then redis.call('ZREM', prefix .. 'capped_users', user) end
  return top
end
