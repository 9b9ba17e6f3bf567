-- claim/places.lua: the places a queued job waits in, and the moves between them. A claim looks
-- at them in this fixed order (claim.lua):
--   1. the front (reclaimed, handed back, retried jobs), the `key.parked` jobs this worker can
--      hold, and the jobs held at a cap whose user is below it now; the lowest seq first;
--   2. `key.prio`: jobs with a priority, the highest first, the lowest seq among equals;
--   3. with fair share, the users' lines (`capped:USER`), the user ranked first next (fairshare.lua);
--   4. the stream's entries, strictly in enqueue order.
-- A job in the stream is also in `key.prio` while it has a priority; every other job is in one place.
-- A job's stream entry is pending (never trimmed) while it waits anywhere but the stream: owned by
-- the 'reclaimed' consumer, or by the worker once it starts.

-- Pass a job over for a worker big enough for it: queued, in `key.parked`, scored GPUs * SEQ + seq,
-- so that a claimer finds the oldest job it can hold with one look per GPU count present.
function places.park(j, gpus)
  redis.call('ZADD', key.parked, gpus * SEQ + j.seq, j.id)
  wake(req.prefix)
end

-- Out of the front (the front's own ZSET, or `key.parked`), to start: its pending entry becomes this worker's.
function places.take_from_front(j, place)
  redis.call('ZREM', place, j.id)
  redis.call('XCLAIM', key.stream, req.group, req.worker, 0, j.entry, 'JUSTID')
end

-- Out of its user's held line, to start.
function places.take_from_held(j)
  unhold(req.prefix, j.user, j.id)
  redis.call('XCLAIM', key.stream, req.group, req.worker, 0, j.entry, 'JUSTID')
end

-- Out of `key.prio` (or the stream, not delivered), to start or move: its entry is deleted
-- undelivered, so the stream never offers it again.
function places.take_from_prio(j)
  redis.call('ZREM', key.prio, j.id)
  redis.call('XDEL', key.stream, j.entry)
end

-- The oldest parked job this worker can hold, and its seq (nil when there is none). Where the
-- worker counts its CPUs and memory (host.lua), a job too big for it in those is passed over: a
-- look at the oldest HELD_LOOK of each GPU count.
function places.oldest_parked()
  local best, best_seq, from = nil, nil, '-inf'
  local upto = '(' .. string.format('%d', (req.gpus_total + 1) * SEQ)
  local look = host.counted() and HELD_LOOK or 1
  while true do
    local p = redis.call('ZRANGEBYSCORE', key.parked, from, upto, 'WITHSCORES', 'LIMIT', 0, look)
    if not p[1] then return best, best_seq end
    local g = math.floor(tonumber(p[2]) / SEQ)
    for i = 1, #p, 2 do
      local seq = tonumber(p[i + 1]) - g * SEQ
      if seq >= SEQ or (best_seq and seq >= best_seq) then break end  -- (past this GPU count, or not older)
      if look == 1 or not host.too_big(job.peek(p[i])) then
        best, best_seq = p[i], seq
        break
      end
    end
    from = string.format('%d', (g + 1) * SEQ)  -- the next GPU count present
  end
end

-- The oldest job held at a cap that this worker can hold and whose user is below the caps now,
-- its seq and its user; nil when there is none. A look per user holding jobs, at their oldest
-- HELD_LOOK held jobs: one too big for this worker or for the GPU cap does not hide the others.
-- In a fair-share queue, where the users' lines hold every job read from the stream, only those
-- held from the front (`capped_front`, HELD_LOOK of them): they go before the priorities, as
-- the front does; the others wait their turn (fairshare.lua).
function places.oldest_released()
  if req.half_life_ms > 0 then
    local held = redis.call('ZRANGE', req.prefix .. 'capped_front', 0, HELD_LOOK - 1, 'WITHSCORES')
    for i = 1, #held, 2 do
      local j = job.peek(held[i])
      local g = fit.need_of(j)
      if g <= req.gpus_total and caps.under_cap(j.user, g) then return held[i], tonumber(held[i + 1]), j.user end
    end
    return nil
  end
  if redis.call('EXISTS', key.capped_users) == 0 then return nil end
  local best, best_seq, best_user = nil, nil, nil
  for _, user in ipairs(redis.call('ZRANGE', key.capped_users, 0, -1)) do
    local held = redis.call('ZRANGE', req.prefix .. 'capped:' .. user, 0, HELD_LOOK - 1, 'WITHSCORES')
    for i = 1, #held, 2 do
      local seq = tonumber(held[i + 1])
      if best_seq and seq >= best_seq then break end
      local g = fit.need_of(job.peek(held[i]))
      if g <= req.gpus_total and caps.under_cap(user, g) then
        best, best_seq, best_user = held[i], seq, user
        break
      end
    end
  end
  return best, best_seq, best_user
end

-- The stream's newest entry, and the last the group delivered: where a claimer that found nothing
-- more waits after.
function places.newest()
  local top = redis.call('XREVRANGE', key.stream, '+', '-', 'COUNT', 1)[1]
  return top and top[1] or '0-0'
end

function places.delivered()
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', key.stream)) do
    local fields = {}
    for i = 1, #g, 2 do fields[g[i]] = g[i + 1] end
    if fields['name'] == req.group then return fields['last-delivered-id'] end
  end
  return '0-0'
end

-- Out of whichever place it waits in, to start now (a preempting head's: front.lua): a pending
-- entry becomes this worker's, one never delivered is deleted.
function places.take_from_anywhere(j)
  local pending = redis.call('ZREM', key.front, j.id) + redis.call('ZREM', key.parked, j.id)
  if redis.call('ZSCORE', req.prefix .. 'capped', j.id) then
    unhold(req.prefix, j.user, j.id)
    pending = 1
  end
  redis.call('ZREM', key.prio, j.id)
  if pending > 0 then
    redis.call('XCLAIM', key.stream, req.group, req.worker, 0, j.entry, 'JUSTID')
  else
    redis.call('XDEL', key.stream, j.entry)
  end
end
