-- lib/record.lua: a job's record and stream entry, Redis time, the fence, waking workers.

-- The key of job `id`'s record; its attempts and log are this key + ':attempts' and ':log'
-- (the layout of daemon/queue/keys.py, which names every key).
local function job_key(prefix, id)
  return prefix .. 'job:' .. id
end

-- The first free job id at `id` or after it (`id`, `id`z1, `id`z2, ...): two ids drawn in the same
-- millisecond are made unique where they were drawn, so a batch keeps its order and a caller never
-- draws again. With `spec` given, a job holding that very spec is taken for this call run again (its
-- reply was lost), and its id is answered as found: {id, key, true}. Else {id, key, false}.
local function free_job_id(prefix, id, spec)
  local k, candidate = 0, id
  while true do
    local key = job_key(prefix, candidate)
    if redis.call('EXISTS', key) == 0 then return {candidate, key, false} end
    if spec and redis.call('HGET', key, 'spec') == spec then return {candidate, key, true} end
    k = k + 1
    candidate = id .. 'z' .. k
  end
end

-- Redis server time in ms: leases are judged by this one clock, never by the workers' clocks.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Drop a job's stream entry: acknowledged (out of the pending list) and deleted.
local function drop_entry(stream, group, entry)
  if entry and entry ~= '' then  -- (a job that waited for others and never joined has none)
    redis.call('XACK', stream, group, entry)
    redis.call('XDEL', stream, entry)
  end
end

-- The fence every write for an attempt passes: the job runs this attempt, under this worker, on
-- this lease. `j` holds the job's 'state', 'attempt', 'worker', 'lease' fields, in that order.
local function holds(j, attempt, consumer, lease)
  return j[1] == 'running' and j[2] == attempt and j[3] == consumer and j[4] == lease
end

-- Wake workers blocked on the queue (XREAD on its `wake` stream): something went to the front, or a
-- user's attempt ended while jobs are held at a cap.
local function wake(prefix)
  redis.call('XADD', prefix .. 'wake', 'MAXLEN', '~', 100, '*', 'w', '1')
end
