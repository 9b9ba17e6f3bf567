-- claim/front.lua: the front of the queue, served before any job not yet started.

-- A job that preempted jobs here goes first, as soon as it fits; until then nothing that could
-- delay it starts here (its reservation is renewed by each claim of this worker). A pilot whose
-- time left ran short of it since keeps no GPUs for it, and nor does a job that failed meanwhile
-- and waits out its retry back-off (it comes back to the front once that is over): the
-- reservation is dropped.
function front.take_preempting_head()
  local r = redis.call('HMGET', key.reservation, 'job', 'worker', 'until', 'preempt')
  if not (r[4] == '1' and r[2] == req.worker and tonumber(r[3]) > now) then return end
  local j = job.of(r[1])
  if j.state ~= 'queued' then return end
  if fit.passed_over(j) or redis.call('ZSCORE', req.prefix .. 'backoff', j.id) then
    redis.call('DEL', key.reservation)
    return
  end
  local gpus = fit.need_of(j)
  redis.call('HSET', key.reservation, 'until', now + req.lease_ms)
  if req.count > 0 and fit.fits_now(j, gpus) and not host.short(j) and caps.under_cap(j.user, gpus) then
    places.take_from_anywhere(j)
    ledger.start(j, gpus)
  elseif not ledger.head_need then
    backfill.keep_for_head({gpus, j.cpus, j.mem_bytes})
  end
end

-- The front (lowest seq first), the parked jobs this worker can hold and the jobs held at
-- a cap whose user is below it now, the oldest first. A job too big for this worker moves to
-- `key.parked`; one whose user is at a cap is held aside (with fair share it keeps its place at the
-- front of its user's line: 'front'); the first that must wait here blocks (backfill.lua). The
-- front is never claimed ahead of a free slot: the claim stops there instead. Returns the reply
-- when the claim ends here, else the number of jobs moved aside.
function front.take()
  local moved = 0
  while #ledger.ids < req.count do
    local r = redis.call('ZRANGE', key.front, 0, 0, 'WITHSCORES')
    local j = r[1] and job.of(r[1])
    if j and fit.need_of(j) > req.gpus_total then
      if moved >= MOVES then return ledger.stop('claimed', '0-0'), moved end  -- cut short: asked again
      redis.call('ZREM', key.front, j.id)  -- too big for this worker: parked (its entry stays pending)
      places.park(j, fit.parked_as(j))
      moved = moved + 1
    else
      local place, pick_seq = key.front, j and j.seq
      local p, p_seq = places.oldest_parked()
      if p and (not j or p_seq < pick_seq) then j, place, pick_seq = job.of(p), key.parked, p_seq end
      local c, c_seq = places.oldest_released()
      if c and (not j or c_seq < pick_seq) then j, place = job.of(c), nil end
      if not j then break end
      if #ledger.ids >= req.slots then return ledger.stop('blocked', places.newest()), moved end
      local v, _, gpus = fit.verdict(j)
      if v == 'gone' then  -- (ended meanwhile: cancel.lua takes it out; this is a bounded tidy)
        if place then redis.call('ZREM', place, j.id) else unhold(req.prefix, j.user, j.id) end
        moved = moved + 1
      elseif v == 'park' and place then  -- parked by a worker with fewer GPUs, too big here too
        if moved >= MOVES then return ledger.stop('claimed', '0-0'), moved end
        redis.call('ZREM', place, j.id)
        places.park(j, gpus)  -- under this worker's need: the GPU counts it looks at no longer hold it
        moved = moved + 1
      elseif v == 'hold' and place then
        if moved >= MOVES then return ledger.stop('claimed', '0-0'), moved end
        redis.call('ZREM', place, j.id)  -- its entry stays pending
        hold(req.prefix, j.user, j.id, j.seq, false, req.half_life_ms > 0)
        moved = moved + 1
      elseif v == 'start' then
        if place then places.take_from_front(j, place) else places.take_from_held(j) end
        ledger.start(j, gpus)
      else
        return backfill.blocked(j, gpus), moved
      end
    end
  end
  return nil, moved
end
