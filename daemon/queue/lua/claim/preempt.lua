-- claim/preempt.lua: preemption, where an admin enables it for the queue. A job with a priority
-- that must wait for GPUs, CPUs or memory on this worker (host.lua), which holds its reservation
-- (backfill.lua), asks this worker's running jobs of lower priority in the queue to stop and be
-- handed back (the flag renew.lua answers 'preempt' to), to make room for all it needs: taken in
-- order (the lowest priority first, the latest started first among equals), only those that free
-- something still short, then any not needed left running, the last taken first. So no job stops
-- for nothing, and a lower-priority one may run on where a higher one that frees more stops (with
-- 1 GPU free, a head needing 3 stops a 2-GPU job of priority 3, not the 1-GPU job of priority 1
-- beside it, which it took first). Nobody stops when all of them would not make room. The
-- reservation is marked so, and this worker's next claims start that job before anything else,
-- and nothing that could delay it meanwhile. A job on a shared GPU waits for memory: it preempts
-- nobody; one running on a shared GPU frees no whole GPU when it stops, only its CPUs and memory.

-- Ask this worker's running jobs of this queue with a priority below job `j`'s to stop (chosen as
-- the top says) to make room for its `gpus` GPUs, its CPUs and its memory (a resource the worker
-- does not count is never short: host.lua) and, with `slot`, for a slot too; jobs already asked to
-- stop count as leaving, and what they hold as free. True when there is room, or will be.
function preempt.make_room(j, gpus, slot)
  local need, counted = {gpus, j.cpus, j.mem_bytes}, {true, host.cpus_total > 0, host.mem_total > 0}
  local have, leaving, victims = {ledger.gpus_free, host.cpus_free, host.mem_free}, 0, {}
  for _, id in ipairs(redis.call('ZRANGE', key.leases, 0, -1)) do
    local v = redis.call('HMGET', job_key(req.prefix, id), 'worker', 'priority', 'held_gpus', 'started_at',
      'requeue', 'cancel', 'seq', 'shared_gpu', 'cpus', 'mem_bytes')
    -- What it frees when it stops: its whole GPUs (none from a shared GPU), CPUs and memory.
    local whole = (tonumber(v[8]) or -1) < 0 and tonumber(v[3]) or 0
    local holds = {whole, tonumber(v[9]) or 0, tonumber(v[10]) or 0}
    if v[1] == req.worker and (v[5] or v[6] == '1') then
      for r = 1, 3 do have[r] = have[r] + holds[r] end
      leaving = leaving + 1
    elseif v[1] == req.worker and (tonumber(v[2]) or 0) < j.priority then
      victims[#victims + 1] = {id = id, priority = tonumber(v[2]) or 0, started = tonumber(v[4]) or 0,
        holds = holds, seq = tonumber(v[7]) or 0}
    end
  end
  table.sort(victims, function(a, b)  -- the lowest priority, the latest started, the latest queued
    if a.priority ~= b.priority then return a.priority < b.priority end
    if a.started ~= b.started then return a.started > b.started end
    return a.seq > b.seq
  end)
  local chosen, n = {}, 0
  local function short(r) return counted[r] and have[r] < need[r] end
  local function room() return not (short(1) or short(2) or short(3)) and (not slot or leaving + n > 0) end
  local function move(v, sign)
    for r = 1, 3 do have[r] = have[r] + sign * v.holds[r] end
    n = n + sign
  end
  for _, v in ipairs(victims) do
    if room() then break end
    local helps = slot and leaving + n == 0
    for r = 1, 3 do helps = helps or (short(r) and v.holds[r] > 0) end
    if helps then chosen[#chosen + 1] = v; move(v, 1) end
  end
  if not room() or leaving + n == 0 then return false end  -- no room, or none needed
  -- One taken early may be needless once later ones freed more (a job taken for a slot, or for a
  -- GPU, when the one taken for the CPUs held GPUs too): the last taken first, each left running
  -- where the room stays without it.
  for i = #chosen, 1, -1 do
    move(chosen[i], -1)
    if room() then chosen[i] = false else move(chosen[i], 1) end
  end
  for _, v in ipairs(chosen) do
    if v then redis.call('HSET', job_key(req.prefix, v.id), 'requeue', 'preempt') end
  end
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
        and preempt.may(j) and preempt.make_room(j, gpus, true) then
      redis.call('HSET', key.reservation, 'job', top, 'worker', req.worker, 'until', now + req.lease_ms, 'at', now,
        'preempt', '1')
      status = 'preempting'
    end
  end
  return ledger.stop(status, places.newest())
end
