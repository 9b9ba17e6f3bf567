-- claim/backfill.lua: the head of line, its reservation and backfill. When the next job needs more
-- GPUs than the claimer has free (less what this call already handed out), or more CPUs or memory
-- (host.lua), claiming stops there and that job waits for them (the head). The head reserves this
-- worker (`key.reservation`: one per queue, for a lease, renewed by each claim of its worker; a
-- worker that dies lets it lapse), unless another live worker holds its reservation. Jobs behind
-- it may then start: on any worker the head is not reserved on; on the one it is, only a job whose
-- time limit (plus stop grace) ends before the head could start there (the running jobs' limits
-- say when: one without a limit may end any moment). So no job it waits behind can delay it, and
-- it starts once its reserved worker has all it needs free (its GPUs, CPUs and memory). A worker
-- holding a reservation keeps all the head needs (its GPUs, CPUs and memory) from the queues it
-- claims from after this one in the same round too: the reply carries that need and the next
-- queue's request brings it back (`kept`), so a job there starts only if it ends before the head
-- could start, as one of the head's own queue does.

-- When the running jobs here end at the latest: {ms from now, GPUs, CPUs, bytes of memory}, the
-- soonest first.
backfill.ends = {}
for _, e in ipairs(req.ends) do
  backfill.ends[#backfill.ends + 1] = {math.max(0, e[1]), e[2], e[3] or 0, e[4] or 0}
end
table.sort(backfill.ends, function(a, b) return a[1] < b[1] end)

-- When `need` ({GPUs, CPUs, bytes of memory}) could be free here at the earliest (ms from now):
-- the running jobs end at their limits, and what is in use that `backfill.ends` does not account
-- for (jobs without a limit, jobs claimed in this very call) may come back any moment. A resource
-- the worker does not count (host.lua) is never waited for.
function backfill.earliest(need)
  local total = {req.gpus_total, host.cpus_total, host.mem_total}
  local free = {total[1], total[2], total[3]}
  for _, e in ipairs(backfill.ends) do
    for r = 1, 3 do free[r] = free[r] - e[r + 1] end
  end
  local function enough()
    for r = 1, 3 do
      if (r == 1 or total[r] > 0) and free[r] < need[r] then return false end
    end
    return true
  end
  if enough() then return 0 end
  for _, e in ipairs(backfill.ends) do
    for r = 1, 3 do free[r] = free[r] + e[r + 1] end
    if enough() then return e[1] end
  end
  return 0
end

-- Keep what a head job needs here, `need` ({GPUs, CPUs, bytes of memory}), till it could start.
function backfill.keep_for_head(need)
  ledger.head_need, ledger.head_at = need, backfill.earliest(need)
end
if #req.kept > 0 then backfill.keep_for_head(req.kept) end

-- The front's jobs a backfill looks at, in the front's own order (front.lua): the front's ZSET,
-- the parked jobs and the jobs held at a cap that are part of the front (every one in a FIFO
-- queue, those held from the front with fair share), LOOK of each, merged by enqueue seq.
function backfill.front_in_order()
  local out = {}
  local function add(id, seq, place) out[#out + 1] = {id = id, seq = seq, place = place} end
  local got = redis.call('ZRANGE', key.front, 0, LOOK - 1, 'WITHSCORES')
  for i = 1, #got, 2 do add(got[i], tonumber(got[i + 1]), key.front) end
  got = redis.call('ZRANGE', key.parked, 0, LOOK - 1, 'WITHSCORES')
  for i = 1, #got, 2 do add(got[i], tonumber(got[i + 1]) % SEQ, key.parked) end
  if req.half_life_ms > 0 then
    got = redis.call('ZRANGE', req.prefix .. 'capped_front', 0, LOOK - 1, 'WITHSCORES')
    for i = 1, #got, 2 do add(got[i], tonumber(got[i + 1]), nil) end
  else
    for _, user in ipairs(redis.call('ZRANGE', key.capped_users, 0, LOOK - 1)) do
      got = redis.call('ZRANGE', req.prefix .. 'capped:' .. user, 0, HELD_LOOK - 1, 'WITHSCORES')
      for i = 1, #got, 2 do add(got[i], tonumber(got[i + 1]), nil) end
    end
  end
  table.sort(out, function(a, b) return a.seq < b.seq end)
  return out
end

-- Start, behind the head job `head`, the jobs that may start here (verdict 'start'), in the order
-- a claim looks (places.lua), a bounded look at each place. Each taken out of turn from the
-- stream is deleted undelivered, as a priority job's is.
function backfill.behind(head)
  local function may(id)
    if id == head then return nil end
    local v, _, gpus = fit.verdict(job.peek(id))
    if v == 'start' then return job.of(id), gpus end
    return nil
  end
  for _, c in ipairs(backfill.front_in_order()) do
    if #ledger.ids == req.count or #ledger.ids >= req.slots then break end  -- (the front is never claimed ahead)
    local j, gpus = may(c.id)
    if j and c.place then places.take_from_front(j, c.place); ledger.start(j, gpus)
    elseif j then places.take_from_held(j); ledger.start(j, gpus) end
  end
  for _, id in ipairs(redis.call('ZRANGE', key.prio, 0, LOOK - 1)) do
    if #ledger.ids == req.count then return end
    local j, gpus = may(id)
    if j then places.take_from_prio(j); ledger.start(j, gpus) end
  end
  if req.half_life_ms > 0 then  -- the users' lines (a job started from the front above is 'gone' here)
    for _, user in ipairs(redis.call('ZRANGE', key.capped_users, 0, LOOK - 1)) do
      for _, id in ipairs(redis.call('ZRANGE', req.prefix .. 'capped:' .. user, 0, HELD_LOOK - 1)) do
        if #ledger.ids == req.count then return end
        local j, gpus = may(id)
        if j then places.take_from_held(j); ledger.start(j, gpus) end
      end
    end
  end
  if redis.call('EXISTS', key.stream) == 0 then return end
  for _, e in ipairs(redis.call('XRANGE', key.stream, '(' .. places.delivered(), '+', 'COUNT', LOOK)) do
    if #ledger.ids == req.count then return end
    local j, gpus = nil, nil
    if e[2][1] == 'job' then j, gpus = may(e[2][2]) end
    if j then places.take_from_prio(j); ledger.start(j, gpus) end
  end
end

-- Job `j`, the first that must wait here (for its `gpus` GPUs, its CPUs or its memory): it
-- reserves this worker unless another live one holds its reservation (or what a head needs is kept
-- here already, from an earlier queue) or it is not for this worker (fit.lua `fit.passed_over`);
-- it may preempt jobs here; the jobs behind it that may start do (backfill); and the claim stops.
function backfill.blocked(j, gpus)
  local status = 'blocked'
  if not ledger.head_need and not fit.passed_over(j) then
    local r = redis.call('HMGET', key.reservation, 'job', 'worker', 'until')
    if not (r[1] == j.id and r[2] ~= req.worker and tonumber(r[3]) > now) then
      backfill.keep_for_head({gpus, j.cpus, j.mem_bytes})
      redis.call('HSET', key.reservation, 'job', j.id, 'worker', req.worker, 'until', now + req.lease_ms, 'at', now + ledger.head_at,
        'preempt', '0')
      if preempt.may(j) and preempt.make_room(j, gpus, false) then
        redis.call('HSET', key.reservation, 'preempt', '1')
        status = 'preempting'
      end
    end
  end
  backfill.behind(j.id)
  return ledger.stop(status, places.newest())
end
