-- claim/preempt.lua: preemption, where an admin enables it for the queue. A job with a priority
-- that must wait for GPUs on this worker, which holds its reservation (backfill.lua), asks this
-- worker's running jobs of lower priority in the queue to stop and be handed back (the lowest
-- priority first, the latest started first among equals; the flag renew.lua answers 'preempt'
-- to), as few as make room; the reservation is marked so, and this worker's next claims start
-- that job before anything else, and nothing that could delay it meanwhile. A job on a shared GPU
-- waits for memory: it preempts nobody, and its own GPU frees no whole one.

-- Ask as few of this worker's running jobs of this queue with a priority below `p` to stop as
-- make room for `gpus` GPUs (and, with `slot`, for a slot too); jobs already asked to stop count
-- as leaving. True when there is room, or will be.
function preempt.make_room(gpus, p, slot)
  local have, leaving, victims = ledger.gpus_free, 0, {}
  for _, id in ipairs(redis.call('ZRANGE', key.leases, 0, -1)) do
    local j = redis.call('HMGET', job_key(req.prefix, id), 'worker', 'priority', 'held_gpus', 'started_at', 'requeue',
      'cancel', 'seq', 'shared_gpu')
    local g = (tonumber(j[8]) or -1) >= 0 and 0 or tonumber(j[3]) or 0
    if j[1] == req.worker and (j[5] or j[6] == '1') then
      have, leaving = have + g, leaving + 1
    elseif j[1] == req.worker and (tonumber(j[2]) or 0) < p then
      victims[#victims + 1] = {id = id, priority = tonumber(j[2]) or 0, started = tonumber(j[4]) or 0, gpus = g,
        seq = tonumber(j[7]) or 0}
    end
  end
  table.sort(victims, function(a, b)  -- the lowest priority, the latest started, the latest queued
    if a.priority ~= b.priority then return a.priority < b.priority end
    if a.started ~= b.started then return a.started > b.started end
    return a.seq > b.seq
  end)
  local chosen = {}
  for _, v in ipairs(victims) do
    if have >= gpus and (not slot or leaving + #chosen > 0) then break end
    if v.gpus > 0 or (slot and leaving + #chosen == 0) then
      chosen[#chosen + 1] = v.id
      have = have + v.gpus
    end
  end
  if have < gpus or (leaving + #chosen == 0) then return false end  -- no room, or none needed
  for _, id in ipairs(chosen) do redis.call('HSET', job_key(req.prefix, id), 'requeue', 'preempt') end
  return true
end

-- Whether job `j` (needing `gpus`) may ask for room here: it has a priority, asks for whole GPUs,
-- and the queue preempts.
function preempt.may(j)
  return req.preempt and j.priority > 0 and j.mem == 0
end

-- A claim for no job (the worker's slots are all taken) only looks whether the queue's
-- highest-priority job should preempt here (making room for a slot as well), unless it is
-- reserved somewhere already. Answered 'preempting' when it does.
function preempt.check()
  local status = 'blocked'
  local top = redis.call('ZRANGE', key.prio, 0, 0)[1]
  local held = redis.call('HMGET', key.reservation, 'job', 'worker', 'until')
  if top and held[1] == top and tonumber(held[3]) > now then top = nil end  -- reserved (here or elsewhere)
  if req.preempt and top and not ledger.head_need then
    local j = job.of(top)
    local gpus = fit.need_of(j)
    if j.state == 'queued' and gpus <= req.gpus_total and caps.under_cap(j.user, gpus) and not fit.passed_over(j)
        and preempt.may(j) and preempt.make_room(gpus, j.priority, true) then
      redis.call('HSET', key.reservation, 'job', top, 'worker', req.worker, 'until', now + req.lease_ms, 'at', now,
        'preempt', '1')
      status = 'preempting'
    end
  end
  return ledger.stop(status, places.newest())
end
