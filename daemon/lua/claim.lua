-- claim: hand up to N next jobs of one queue to a worker, as leases.
-- Guarantees (atomic, so under any number of concurrent claimers):
--  * one holder: a job is popped from `retry` or delivered by the consumer group, each of which
--    happens once, and it becomes running with attempt+1 under this worker, with a lease deadline;
--  * order: reclaimed jobs (lowest enqueue seq first) go before any job not yet started; stream
--    entries go strictly in enqueue order. Head of line: when the next job needs more GPUs than
--    the claimer has free (less what this call already handed out), claiming stops there and that
--    job waits for a worker that has them. A job asking for 0 GPUs needs the claimer's default
--    (its slot's share of the worker's GPUs);
--  * the attempt number rises on every claim: it is the lease's fencing token;
--  * cancelled jobs and wake markers met on the way are acknowledged and deleted, never run.
-- KEYS: 1 stream, 2 retry, 3 leases
-- ARGV: 1 queue key prefix, 2 group, 3 consumer (worker id), 4 GPUs free, 5 lease duration (ms),
--       6 GPUs a job asking for 0 gets (optional, default 0), 7 most jobs to claim (default 1)
-- Returns {status, cursor, id, attempt, spec, id, attempt, spec, ...}: the claimed jobs, and why
-- claiming stopped: 'claimed' (N jobs), 'empty' (nothing more) or 'blocked' (the next job needs
-- more GPUs). cursor is the stream id to wait after (XREAD BLOCK) before a claim can find more.
local stream, retry, leases = KEYS[1], KEYS[2], KEYS[3]
local prefix, group, consumer = ARGV[1], ARGV[2], ARGV[3]
local gpus_free, lease_ms = tonumber(ARGV[4]), tonumber(ARGV[5])
local default_gpus = tonumber(ARGV[6]) or 0
local wanted = tonumber(ARGV[7]) or 1
local now = now_ms()
local claimed = {}

local function need(jobkey)
  local want = tonumber(redis.call('HGET', jobkey, 'gpus')) or 0
  if want == 0 then want = default_gpus end
  return want
end

local function newest()
  local top = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)[1]
  return top and top[1] or '0-0'
end

local function start(id, jobkey, gpus)
  gpus_free = gpus_free - gpus
  local attempt = redis.call('HINCRBY', jobkey, 'attempt', 1)
  redis.call('HSET', jobkey, 'state', 'running', 'worker', consumer, 'started_at', now)
  redis.call('ZADD', leases, now + lease_ms, id)
  redis.call('RPUSH', jobkey .. ':attempts',
    cjson.encode({attempt = attempt, worker = consumer, started_at = now, how = 'running'}))
  for _, v in ipairs({id, attempt, redis.call('HGET', jobkey, 'spec')}) do claimed[#claimed + 1] = v end
end

local function stop(status, cursor)
  local reply = {status, cursor}
  for _, v in ipairs(claimed) do reply[#reply + 1] = v end
  return reply
end

while #claimed < wanted * 3 do
  local reclaimed = redis.call('ZRANGE', retry, 0, 0)[1]
  if not reclaimed then break end
  local jobkey = prefix .. 'job:' .. reclaimed
  local gpus = need(jobkey)
  if gpus > gpus_free then return stop('blocked', newest()) end
  redis.call('ZREM', retry, reclaimed)
  redis.call('XCLAIM', stream, group, consumer, 0, redis.call('HGET', jobkey, 'entry'), 'JUSTID')
  start(reclaimed, jobkey, gpus)
end
if #claimed == wanted * 3 then return stop('claimed', '0-0') end

if redis.call('EXISTS', stream) == 0 then return stop('empty', '0-0') end
local last = '0-0'
for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
  local fields = {}
  for i = 1, #g, 2 do fields[g[i]] = g[i + 1] end
  if fields['name'] == group then last = fields['last-delivered-id'] end
end

-- Bounded: a long run of dropped entries ends this call; the caller claims again at once.
for _ = 1, 100 + wanted do
  if #claimed == wanted * 3 then return stop('claimed', last) end
  local nxt = redis.call('XRANGE', stream, '(' .. last, '+', 'COUNT', 1)[1]
  if not nxt then return stop('empty', last) end
  local entry, fields = nxt[1], nxt[2]
  local id = fields[1] == 'job' and fields[2] or nil
  local jobkey = id and (prefix .. 'job:' .. id)
  local state = jobkey and redis.call('HGET', jobkey, 'state')
  local gpus = state == 'queued' and need(jobkey) or 0
  if gpus > gpus_free then return stop('blocked', newest()) end
  redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1, 'STREAMS', stream, '>')
  if state == 'queued' then start(id, jobkey, gpus) else drop_entry(stream, group, entry) end
  last = entry
end
return stop(#claimed > 0 and 'claimed' or 'empty', last)
