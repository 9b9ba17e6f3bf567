-- claim/host.lua: a worker's CPUs and memory, fitted with its GPUs. A job asking for CPUs
-- (`cpus`) and bytes of memory (`mem_bytes`; 0: none asked) starts on a worker only where that
-- much of each is free, as its GPUs must be; what it takes is counted out for the jobs after it in
-- the same call (and, through the reply, in the worker's next queue). A job asking for more than
-- the worker has at all is parked as one of too many GPUs is; one asking for more than is free
-- now waits as one whose GPUs are not free does: it may be the head of line, and backfill treats
-- its CPUs and memory as it treats GPUs (backfill.lua `earliest`). A worker that counts neither
-- (its totals 0: an agent's, or an explain of GPUs alone) fits every job here. (A worker of before
-- this part never sees a job with CPUs or memory: the server gives none to a queue it serves.)

host.cpus_free, host.mem_free = req.cpus_free or 0, req.mem_free or 0
host.cpus_total, host.mem_total = req.cpus_total or 0, req.mem_total or 0

-- Whether this worker counts its CPUs or memory at all.
function host.counted()
  return host.cpus_total > 0 or host.mem_total > 0
end

-- Whether the worker has this much of `have` of a resource it counts (`total` > 0).
local function within(need, have, total)
  return total == 0 or need <= have
end

-- Why a job needs more than this worker has at all ('too_many_cpus', 'too_much_memory'), or nil.
function host.too_big(j)
  if not within(j.cpus, host.cpus_total, host.cpus_total) then return 'too_many_cpus' end
  if not within(j.mem_bytes, host.mem_total, host.mem_total) then return 'too_much_memory' end
  return nil
end

-- Why a job cannot have its CPUs and memory here now ('cpus', 'host_memory'), or nil.
function host.short(j)
  if not within(j.cpus, host.cpus_free, host.cpus_total) then return 'cpus' end
  if not within(j.mem_bytes, host.mem_free, host.mem_total) then return 'host_memory' end
  return nil
end

-- Count a started job's CPUs and memory out.
function host.take(cpus, mem_bytes)
  host.cpus_free, host.mem_free = host.cpus_free - cpus, host.mem_free - mem_bytes
end
