-- claim/fit.lua: a job's fit on this worker, and the verdict a claim gives every job it meets.

-- The GPUs a job needs here: what it asks for, or a slot's share when it asks for 0; a job asking
-- for memory on one shared GPU needs one (more than the worker has, when its largest GPU is too
-- small: it is then passed over as a job of too many GPUs is, and so is one asking for more CPUs
-- or memory than the worker has: host.lua).
function fit.need_of(j)
  if host.too_big(j) then return req.gpus_total + 1 end
  return fit.parked_as(j)
end

-- The GPUs a job is parked under (places.park): what it needs of them alone, so that every worker
-- with that many looks at it, whatever its CPUs and memory (places.oldest_parked passes over one
-- too big for it in those).
function fit.parked_as(j)
  if j.mem > 0 then return j.mem <= req.largest_gpu and 1 or req.gpus_total + 1 end
  return j.gpus == 0 and req.slot_gpus or j.gpus
end

-- Whether a job needing `gpus` fits this worker's GPUs now (or a shared GPU's memory).
function fit.fits_now(j, gpus)
  if j.mem > 0 then return packing.gpu_for(j.mem) ~= nil end
  return gpus <= ledger.gpus_free
end

-- The longest a job may run here, in ms: its time limit and stop grace; nil with no time limit.
function fit.run_limit(j)
  local limit, grace = job.limits_of(j)
  if not limit then return nil end
  return limit + (grace or req.grace_ms)
end

-- Why a job is not for this claimer at all, or nil: it could run past the claimer's own end (a
-- pilot's lifetime left; a job with no time limit always could), or it is another user's than the
-- one this claimer serves (a worker not running as root serves one pool user: docs/DESIGN.md).
-- Such a job is never waited for: no reservation, no preemption for it.
function fit.passed_over(j)
  if req.serves ~= '' and j.user ~= req.serves then return 'serves' end
  if req.lifetime_ms <= 0 then return nil end
  local limit = fit.run_limit(j)
  if limit == nil or limit > req.lifetime_ms then return 'outlives' end
  return nil
end

-- Why a job of `gpus` GPUs may not start here now, or nil: its GPUs (or memory on a shared GPU),
-- or its CPUs or memory on the worker (host.lua), are not free, it is not for this claimer, or,
-- with what a head job needs kept here, it is not sure to end before the head could start
-- (backfill.lua).
function fit.cannot_start(j, gpus)
  if not fit.fits_now(j, gpus) then return j.mem > 0 and 'memory' or 'gpus' end
  local short = host.short(j)
  if short then return short end
  local passed = fit.passed_over(j)
  if passed then return passed end
  if not ledger.head_need then return nil end
  local limit = fit.run_limit(j)
  if limit ~= nil and limit <= ledger.head_at then return nil end
  return 'reserved'
end

-- The verdict on a job a claim meets, and its reason code (explain.lua says them in words):
--   'gone'  not queued any more (cancelled, or taken): dropped where it is met;
--   'park'  needs more GPUs than this worker has at all ('too_big'), more memory than its
--           largest GPU ('no_gpu_memory'), or more CPUs or memory than it has ('too_many_cpus',
--           'too_much_memory'): left for a worker big enough, never blocking this one;
--   'hold'  its user is at a cap here ('cap');
--   'wait'  must wait here: its GPUs are not free ('gpus', 'memory'), nor its CPUs or memory on the
--           worker ('cpus', 'host_memory'), it is not for this worker
--           ('outlives', 'serves'), or it could delay a reserved head ('reserved');
--   'start' ('fits').
-- Every place a claim takes jobs from applies the verdict with its own moves (places.lua).
function fit.verdict(j)
  if j.state ~= 'queued' then return 'gone', 'gone', 0 end
  local gpus = fit.need_of(j)
  if gpus > req.gpus_total then
    local too_big = host.too_big(j)
    if too_big then return 'park', too_big, fit.parked_as(j) end
    return 'park', j.mem > 0 and 'no_gpu_memory' or 'too_big', gpus
  end
  if not caps.under_cap(j.user, gpus) then return 'hold', 'cap', gpus end
  local why = fit.cannot_start(j, gpus)
  if why then return 'wait', why, gpus end
  return 'start', 'fits', gpus
end
