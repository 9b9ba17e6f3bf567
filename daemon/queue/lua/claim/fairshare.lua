-- claim/fairshare.lua: fair share (the request's half_life_ms; 0: FIFO). The stream's entries join
-- their users' lines (`capped:USER`, by seq) as they are read, and after the front and the
-- priorities the next start goes to the user ranked first: the least recent use per weight (their
-- decayed use, lib/use.lua `charge`, plus what their running jobs here used so far, each counted as
-- at least one GPU-ms, so that a burst of starts alternates; the weight is the queue's `fairshare`
-- 'w:USER', 1 by default), then fewer jobs running, then the older job; FIFO within one user. The
-- chosen job waits for GPUs at the head as a stream entry would. A job from the front held at its
-- user's cap waits in their line marked 'front', and goes before every line once they are below
-- it, as the front does.

-- The queue's stored use, half-life and weights, read once per call.
fairshare.share = nil
function fairshare.stored_share()
  if not fairshare.share then
    fairshare.share = {}
    local all = redis.call('HGETALL', req.prefix .. 'fairshare')
    for i = 1, #all, 2 do fairshare.share[all[i]] = tonumber(all[i + 1]) end
  end
  return fairshare.share
end

-- A user's decayed use in whole GPU-ms (as lib/use.lua's `decayed`: decayed away is 0), and weight.
function fairshare.use_and_weight(user)
  local s, use = fairshare.stored_share(), 0
  if s['u:' .. user] then
    use = math.floor(s['u:' .. user] * 2 ^ (-(now - s['t:' .. user]) / req.half_life_ms))
  end
  return use, s['w:' .. user] or 1
end

-- A user's rank for their next job (its seq; `from_front`: held from the front): {class, use per
-- weight, jobs running, seq}, the least first.
function fairshare.rank(user, seq, from_front)
  if from_front then return {0, seq, 0, 0} end  -- from the front (held at a cap): before any line
  local use, weight = fairshare.use_and_weight(user)
  local u = ledger.use_of(user)
  return {1, (use + u[3]) / weight, u[1], seq}
end

function fairshare.ranks_before(a, b)
  for i = 1, 4 do
    if a[i] ~= b[i] then return a[i] < b[i] end
  end
  return false
end

-- The stream's new entries join their users' lines (pending under 'reclaimed', as a parked job's,
-- so never trimmed), whatever their size: a job too big for this worker waits in its line, in
-- its user's order, for a worker big enough (parked, it would go before its user's older jobs);
-- a job with a priority stays in `key.prio`, which deletes its entry as it starts.
function fairshare.read_into_lines()
  local fs = req.prefix .. 'fairshare'
  if tonumber(redis.call('HGET', fs, 'half_life')) ~= req.half_life_ms then
    redis.call('HSET', fs, 'half_life', req.half_life_ms)  -- what attempts ending here charge by (_lib.lua)
  end
  local read = redis.call('XREADGROUP', 'GROUP', req.group, 'reclaimed', 'COUNT', STREAM_READ + req.count,
    'STREAMS', key.stream, '>')
  local entries = read and read[1][2] or {}
  local listed = {}  -- the users whose line this call added to: listed in `key.capped_users` already
  for _, e in ipairs(entries) do
    local j = e[2][1] == 'job' and job.of(e[2][2]) or nil
    if not j or j.state ~= 'queued' then
      drop_entry(key.stream, req.group, e[1])
    elseif j.priority > 0 and redis.call('ZSCORE', key.prio, j.id) then
      redis.call('XACK', key.stream, req.group, e[1])
    else
      hold(req.prefix, j.user, j.id, j.seq, listed[j.user])
      listed[j.user] = true
    end
  end
  return #entries
end

-- Starts from the users' lines, the user ranked first each time. Each user's next job is looked
-- up once per call, and again for the user whose job just started or could not start here (at a
-- cap: the next of theirs, up to HELD_LOOK deep; too big for this worker: the next, past as many
-- such as the call's MOVES allow, so a run of big jobs does not hide a user's small ones).
-- Returns the reply.
function fairshare.take()
  local read = fairshare.read_into_lines()
  local next_of = {}  -- user -> {id, seq, place in their line, held from the front} or false
  local too_big, passed = {}, 0  -- per user, and in all: jobs too big for this worker passed
  local function look(user, place)
    next_of[user] = false
    if place >= HELD_LOOK + (too_big[user] or 0) then return end
    local held = redis.call('ZRANGE', req.prefix .. 'capped:' .. user, place, place, 'WITHSCORES')
    if held[1] then
      next_of[user] = {held[1], tonumber(held[2]), place, redis.call('HGET', job_key(req.prefix, held[1]), 'front')}
    end
  end
  local users = redis.call('ZRANGE', key.capped_users, 0, -1)
  for _, user in ipairs(users) do look(user, 0) end
  while #ledger.ids < req.count do
    local best, best_rank, best_user = nil, nil, nil
    for _, user in ipairs(users) do
      local nxt = next_of[user]
      if nxt then
        local r = fairshare.rank(user, nxt[2], nxt[4])
        if not best or fairshare.ranks_before(r, best_rank) then best, best_rank, best_user = nxt, r, user end
      end
    end
    if not best then break end
    local j = job.of(best[1])
    local v, _, gpus = fit.verdict(j)
    if v == 'wait' then return backfill.blocked(j, gpus) end
    if v == 'start' then
      local top = unhold(req.prefix, best_user, j.id)
      redis.call('XCLAIM', key.stream, req.group, req.worker, 0, j.entry, 'JUSTID')
      ledger.start(j, gpus)
      next_of[best_user] = false
      if top[1] then look(best_user, 0) end
    else
      if v == 'park' then
        passed = passed + 1
        if passed >= MOVES then return ledger.stop('claimed', '0-0') end  -- cut short: asked again
        too_big[best_user] = (too_big[best_user] or 0) + 1
      end
      look(best_user, best[3] + 1)  -- passed over here: the next of theirs
    end
  end
  if #ledger.ids == req.count or read == STREAM_READ + req.count then return ledger.stop('claimed', '0-0') end
  return ledger.stop('empty', places.delivered())
end
