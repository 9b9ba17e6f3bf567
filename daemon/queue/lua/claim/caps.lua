-- claim/caps.lua: caps per user (max_jobs, max_gpus; 0: none). A job whose user already runs that
-- many jobs, or would hold more than that many GPUs, in this queue is held aside (`capped`, by
-- seq; lib/caps.lua `hold`) rather than started or waited for, and the jobs behind it go on; it
-- returns to the front, by its seq, once its user is below the caps (counted from the queue's
-- leases at each call: ledger.lua `ledger.use_of`). A user with nothing running here always gets one
-- job, however big: no cap can starve a user.

-- Whether `user` may start one more job of `gpus` GPUs in this queue.
function caps.under_cap(user, gpus)
  if (req.max_jobs == 0 and req.max_gpus == 0) or user == '' then return true end
  local u = ledger.use_of(user)
  if u[1] == 0 then return true end
  return (req.max_jobs == 0 or u[1] < req.max_jobs) and (req.max_gpus == 0 or u[2] + gpus <= req.max_gpus)
end
