-- claim/priorities.lua: the jobs with a priority (`prio`), after the front: the highest first, the
-- lowest seq among equals. Each leaves the stream as it is taken: its entry is deleted
-- undelivered, so the stream never offers it again. A priority job's place is its priority's: it
-- heads the line, and waits for GPUs at its head as the stream's first entry would. In a
-- fair-share queue a job whose user is at a cap keeps its place here (passed over, a bounded
-- look): held in its user's line it would lose its priority to the user's later ones.
-- `moved`: the jobs the front moved aside in this call. Returns the reply when the claim ends here.
local function take_priorities(moved)
  local passed = 0
  while #ids < wanted do
    local top = redis.call('ZRANGE', prio, passed, passed)[1]
    if not top then break end
    local j = job_of(top)
    local v, _, gpus = verdict(j)
    if v == 'wait' then return blocked(j, gpus) end
    if v == 'hold' and half_life > 0 then
      passed = passed + 1
      if passed >= MOVES then break end
    else
      if v == 'park' or v == 'hold' then
        if moved >= MOVES then return stop('claimed', '0-0') end  -- cut short: asked again
        moved = moved + 1
      end
      redis.call('ZREM', prio, top)
      if v ~= 'gone' then  -- (cancel and take remove a job from `prio` as it leaves 'queued')
        redis.call('XDEL', stream, j.entry)
        if v == 'park' then park(j, gpus)
        elseif v == 'hold' then hold(prefix, j.user, j.id, j.seq)
        else start(j, gpus) end
      end
    end
  end
  return nil
end
