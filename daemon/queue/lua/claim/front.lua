-- claim/front.lua: the front of the queue, served before any job not yet started.

-- A job that preempted jobs here goes first, as soon as it fits; until then nothing that could
-- delay it starts here (its reservation is renewed by each claim of this worker). A pilot whose
-- time left ran short of it since keeps no GPUs for it, and nor does a job that failed meanwhile
-- and waits out its retry back-off (it comes back to the front once that is over): the
-- reservation is dropped.
local function take_preempting_head()
  local r = redis.call('HMGET', reservation, 'job', 'worker', 'until', 'preempt')
  if not (r[4] == '1' and r[2] == consumer and tonumber(r[3]) > now) then return end
  local j = job_of(r[1])
  if j.state ~= 'queued' then return end
  if passed_over(j) or redis.call('ZSCORE', prefix .. 'backoff', j.id) then
    redis.call('DEL', reservation)
    return
  end
  local gpus = need_of(j)
  redis.call('HSET', reservation, 'until', now + lease_ms)
  if wanted > 0 and fits_now(j, gpus) and under_cap(j.user, gpus) then
    take_from_anywhere(j)
    start(j, gpus)
  elseif not head_need then
    keep_for_head(gpus)
  end
end

-- The front (lowest seq first), the parked jobs this worker can hold and the jobs held at
-- a cap whose user is below it now, the oldest first. A job too big for this worker moves to
-- `parked`; one whose user is at a cap is held aside (with fair share it keeps its place at the
-- front of its user's line: 'front'); the first that must wait here blocks (backfill.lua). The
-- front is never claimed ahead of a free slot: the claim stops there instead. Returns the reply
-- when the claim ends here, else the number of jobs moved aside.
local function take_front()
  local moved = 0
  while #ids < wanted do
    local r = redis.call('ZRANGE', front, 0, 0, 'WITHSCORES')
    local j = r[1] and job_of(r[1])
    if j and need_of(j) > gpus_total then
      if moved >= MOVES then return stop('claimed', '0-0'), moved end  -- cut short: asked again
      redis.call('ZREM', front, j.id)  -- too big for this worker: parked (its entry stays pending)
      park(j, need_of(j))
      moved = moved + 1
    else
      local place, pick_seq = front, j and j.seq
      local p, p_seq = oldest_parked()
      if p and (not j or p_seq < pick_seq) then j, place, pick_seq = job_of(p), parked, p_seq end
      local c, c_seq = oldest_released()
      if c and (not j or c_seq < pick_seq) then j, place = job_of(c), nil end
      if not j then break end
      if #ids >= slots then return stop('blocked', newest()), moved end
      local v, _, gpus = verdict(j)
      if v == 'gone' then  -- (ended meanwhile: cancel.lua takes it out; this is a bounded tidy)
        if place then redis.call('ZREM', place, j.id) else unhold(prefix, j.user, j.id) end
        moved = moved + 1
      elseif v == 'park' and place then  -- parked by a worker with fewer GPUs, too big here too
        if moved >= MOVES then return stop('claimed', '0-0'), moved end
        redis.call('ZREM', place, j.id)
        park(j, gpus)  -- under this worker's need: the GPU counts it looks at no longer hold it
        moved = moved + 1
      elseif v == 'hold' and place then
        if moved >= MOVES then return stop('claimed', '0-0'), moved end
        redis.call('ZREM', place, j.id)  -- its entry stays pending
        hold(prefix, j.user, j.id, j.seq, false, half_life > 0)
        moved = moved + 1
      elseif v == 'start' then
        if place then take_from_front(j, place) else take_from_held(j) end
        start(j, gpus)
      else
        return blocked(j, gpus), moved
      end
    end
  end
  return nil, moved
end
