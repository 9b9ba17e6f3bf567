-- explain: why queued jobs wait, said by the same parts that decide (claim/), without claiming.
-- Guarantees: read only (it calls none of the parts that write), so it cannot change what a claim
-- will do; its answer is what a claim by a worker as described would decide now, in one atomic
-- view of the queue.
-- KEYS: as claim.lua's (the memo is never touched)
-- ARGV: 1 a request (daemon/queue/claims.py `ClaimRequest`) of a worker as big as the queue's
--       biggest live one, its GPUs all free; 2.. the ids of the jobs to explain
-- Returns, for each job: {id, place, verdict, reason, the user's recent use (GPU-ms, fair share's
-- decay plus what they run here), their weight, jobs they run here, the users whose turn comes
-- first (fair share; space-separated)}. Place: 'front', 'parked', 'held' (at a cap, or in its
-- user's line), 'prio', 'stream', 'waiting' (for others, or its array's window), 'backoff',
-- 'running' or 'gone'; verdict and reason: claim/fit.lua `fit.verdict`'s.
--! include lib/record.lua
--! include lib/caps.lua
--! include claim/request.lua
--! include claim/job.lua
--! include claim/packing.lua
--! include claim/host.lua
--! include claim/ledger.lua
--! include claim/caps.lua
--! include claim/fit.lua
--! include claim/places.lua
--! include claim/fairshare.lua

local PLACES = {{key.front, 'front'}, {key.parked, 'parked'}, {req.prefix .. 'capped', 'held'}, {key.prio, 'prio'},
  {req.prefix .. 'waiting', 'waiting'}, {req.prefix .. 'backoff', 'backoff'}, {key.leases, 'running'}}

local function place_of(j)
  if j.state ~= 'queued' and j.state ~= 'running' then return 'gone' end
  for _, p in ipairs(PLACES) do
    if redis.call('ZSCORE', p[1], j.id) then return p[2] end
  end
  return 'stream'
end

-- With fair share, each user's next job as the next claim would rank it: the head of their line,
-- or their first entry the stream has not delivered yet (read into the lines at the next claim;
-- a bounded look, STREAM_READ entries).
local next_jobs = nil
local function users_next()
  if next_jobs then return next_jobs end
  next_jobs = {}
  for _, user in ipairs(redis.call('ZRANGE', key.capped_users, 0, -1)) do
    local top = redis.call('ZRANGE', req.prefix .. 'capped:' .. user, 0, 0, 'WITHSCORES')
    if top[1] then
      next_jobs[user] = {tonumber(top[2]), redis.call('HGET', job_key(req.prefix, top[1]), 'front')}
    end
  end
  if redis.call('EXISTS', key.stream) == 1 then
    for _, e in ipairs(redis.call('XRANGE', key.stream, '(' .. places.delivered(), '+', 'COUNT', STREAM_READ)) do
      local j = e[2][1] == 'job' and job.of(e[2][2]) or nil
      if j and j.state == 'queued' and j.priority == 0 and not next_jobs[j.user] then
        next_jobs[j.user] = {j.seq, false}
      end
    end
  end
  return next_jobs
end

-- With fair share, the users waiting whose next job ranks before `j` (fairshare.lua `fairshare.rank`).
local function ranked_before(j)
  if req.half_life_ms == 0 or j.state ~= 'queued' then return '' end
  local mine = fairshare.rank(j.user, j.seq, redis.call('HGET', j.key, 'front'))
  local first = {}
  for user, nxt in pairs(users_next()) do
    if user ~= j.user and fairshare.ranks_before(fairshare.rank(user, nxt[1], nxt[2]), mine) then first[#first + 1] = user end
  end
  table.sort(first)
  return table.concat(first, ' ')
end

local out = {}
for i = 2, #ARGV do
  local j = job.of(ARGV[i])
  local v, why = fit.verdict(j)
  local use, weight = 0, 1
  if req.half_life_ms > 0 then use, weight = fairshare.use_and_weight(j.user) end
  local u = ledger.use_of(j.user)
  out[#out + 1] = {j.id, place_of(j), v, why, tostring(use + u[3]), tostring(weight), u[1], ranked_before(j)}
end
return out
