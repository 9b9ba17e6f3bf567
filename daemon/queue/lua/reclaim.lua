-- reclaim: take back the attempts whose lease deadline (Redis server time) has passed.
-- Guarantees: only a lease past its deadline is taken, so a job whose worker keeps renewing is
-- never reclaimed however long it runs. Each taken attempt is closed as 'lost' in the history and
-- counted in `losses` (but one claimed ahead of a free slot that never started, which is closed
-- as 'released' and counted as a hand-back, as a draining worker's: claim.lua, started.lua); its job goes back to the front of the queue (claimed before any
-- job not yet started, with attempt+1 and a new lease id at that claim, which fences the old
-- holder out), or, when the user cancelled it, becomes cancelled; or, once `losses` reaches
-- max_attempts, dead (dead-letter). Losses alone count: attempts that failed and were retried
-- (`failures`) and attempts a draining worker handed back (`handbacks`) do not. Entries stay
-- pending until the job ends, so nothing a reclaimed job needs is ever trimmed. And the failed jobs
-- whose retry back-off is over (`backoff`, complete.lua) go to the front too, workers woken. Safe
-- to run twice (a lease taken, or a job moved, is gone); at maxmemory it still runs (its first
-- write is a deletion).
-- KEYS: 1 stream, 2 the front, 3 leases, 4 events
-- ARGV: 1 queue key prefix, 2 group, 3 most to take in one call, 4 retention (s), 5 days an
--       ended job's accounting record is kept (lib/account.lua; absent: its default)
-- Returns a flat list: how many leases it took (up to the limit), then job id, new state, job id,
-- new state, ... for those whose job was running.
--! include lib/record.lua
--! include lib/use.lua
--! include lib/finish.lua
--! include lib/front.lua
local stream, front, leases, events = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local prefix, group, limit, retention = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
local backoff = prefix .. 'backoff'
local due = redis.call('ZRANGEBYSCORE', backoff, '-inf', now, 'LIMIT', 0, limit)
for _, id in ipairs(due) do
  redis.call('ZREM', backoff, id)
  if redis.call('HGET', job_key(prefix, id), 'state') == 'queued' then
    to_front(prefix, stream, group, front, id)
  end
end
if #due > 0 then wake(prefix) end
local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', now, 'LIMIT', 0, limit)
local out = {#expired}
for _, id in ipairs(expired) do
  redis.call('ZREM', leases, id)
  local jobkey = job_key(prefix, id)
  local j = redis.call('HMGET', jobkey, 'state', 'max_attempts', 'cancel', 'ahead')
  if j[1] == 'running' then
    local unstarted = j[4] == '1'  -- claimed ahead of a free slot, never started (started.lua)
    close_attempt(prefix, jobkey, unstarted and 'released' or 'lost', now)
    local losses = 0
    if unstarted then
      redis.call('HDEL', jobkey, 'ahead')
      redis.call('HINCRBY', jobkey, 'handbacks', 1)
    else
      losses = redis.call('HINCRBY', jobkey, 'losses', 1)
    end
    local state
    if j[3] == '1' then
      state = 'cancelled'
    elseif not unstarted and losses >= tonumber(j[2]) then
      state = 'dead'
      redis.call('HSET', jobkey, 'detail', 'lost ' .. losses .. ' attempts (max_attempts)')
    else
      state = 'queued'
      requeue(prefix, stream, group, front, id)
    end
    if state ~= 'queued' then finish(prefix, stream, group, events, id, state, now, retention, nil, nil, ARGV[5]) end
    out[#out + 1] = id
    out[#out + 1] = state
  end
end
return out
