-- lib/use.lua: what a user used, charged as each attempt ends (fair share, accounting).
--! include lib/account.lua

-- Fair share (claim.lua): a queue whose claims rank users by recent use keeps, in its `fairshare`
-- hash, the half-life its claimers decay use by ('half_life', ms) and each user's use at a time
-- ('u:USER', GPU-ms; 't:USER', ms). A job counts as one GPU when it holds none, so CPU jobs share
-- fairly too. `decayed` is a user's stored use as of `now`: halved every half-life since it was
-- stored.
local function decayed(fs, user, now, half)
  local u = redis.call('HMGET', fs, 'u:' .. user, 't:' .. user)
  if not u[1] then return 0 end
  return tonumber(u[1]) * 2 ^ (-(now - tonumber(u[2])) / half)
end

-- Charge the attempt ending now to its user's use, from when it started ('ran_from': its claim,
-- or for one claimed ahead of a free slot when its worker said it started, started.lua), in a
-- fair-share queue (no-op elsewhere: a queue whose claimers never ranked by use has no
-- half-life, and for an attempt claimed ahead that never started).
local function charge(prefix, jobkey, now)
  local fs = prefix .. 'fairshare'
  local half = tonumber(redis.call('HGET', fs, 'half_life'))
  if not half then return end
  local j = redis.call('HMGET', jobkey, 'user', 'held_gpus', 'started_at', 'ahead', 'ran_from')
  if not j[1] or not j[3] or j[4] == '1' then return end  -- (claimed ahead, never started: nothing used)
  local from = tonumber(j[5]) or tonumber(j[3])  -- its start; for a record of before 'ran_from', its claim
  local used = math.max(1, tonumber(j[2]) or 0) * math.max(0, now - from)
  redis.call('HSET', fs, 'u:' .. j[1], string.format('%.0f', decayed(fs, j[1], now, half) + used),
    't:' .. j[1], now)
end

-- Close the newest attempt in a job's history, if it is still open, and charge its use (to the
-- user's fair share, and to the job's totals for its accounting record; `util`: the attempt's
-- mean GPU utilisation in percent, where its worker measured it, lib/account.lua).
local function close_attempt(prefix, jobkey, how, now, util)
  charge(prefix, jobkey, now)
  tally(jobkey, now, util)
  local hist = jobkey .. ':attempts'
  local last = redis.call('LINDEX', hist, -1)
  if last then
    local a = cjson.decode(last)
    if a.how == 'running' then
      a.how = how
      a.ended_at = now
      redis.call('LSET', hist, -1, cjson.encode(a))
    end
  end
end
