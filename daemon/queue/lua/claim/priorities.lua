-- claim/priorities.lua: the jobs with a priority (`key.prio`), after the front: the highest first, the
-- lowest seq among equals. Each leaves the stream as it is taken: its entry is deleted
-- undelivered, so the stream never offers it again. A priority job's place is its priority's: it
-- heads the line, and waits for GPUs at its head as the stream's first entry would. In a
-- fair-share queue a job whose user is at a cap keeps its place here (passed over, a bounded
-- look): held in its user's line it would lose its priority to the user's later ones.
-- `moved`: the jobs the front moved aside in this call. Returns the reply when the claim ends here.
function priorities.take(moved)
  local passed = 0
  while #ledger.ids < req.count do
    local top = redis.call('ZRANGE', key.prio, passed, passed)[1]
    if not top then break end
    local j = job.of(top)
    local v, _, gpus = fit.verdict(j)
    if v == 'wait' then return backfill.blocked(j, gpus) end
    if v == 'hold' and req.half_life_ms > 0 then
      passed = passed + 1
      if passed >= MOVES then break end
    else
      if v == 'park' or v == 'hold' then
        if moved >= MOVES then return ledger.stop('claimed', '0-0') end  -- cut short: asked again
        moved = moved + 1
      end
      redis.call('ZREM', key.prio, top)
      if v ~= 'gone' then  -- (cancel and take remove a job from `key.prio` as it leaves 'queued')
        redis.call('XDEL', key.stream, j.entry)
        if v == 'park' then places.park(j, gpus)
        elseif v == 'hold' then hold(req.prefix, j.user, j.id, j.seq)
        else ledger.start(j, gpus) end
      end
    end
  end
  return nil
end
