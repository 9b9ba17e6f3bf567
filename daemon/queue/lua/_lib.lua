-- Helpers shared by every script; daemon/queue/scripts.py prepends this file to each one at load time.
-- Every key derived here comes from a queue's key prefix, so it carries that queue's hash tag and
-- lives in the same Redis Cluster slot as the script's declared KEYS.
--
-- Two rules every script keeps:
--
-- * Run twice, act once. A script call can reach Redis twice: redis-py re-sends a command whose
--   connection broke before the reply came, and so does a worker that never heard back. Each
--   script either has no second effect by nature (renew, reclaim, cancel, heartbeat) or recognises
--   its own earlier run and answers as it did then: claim by the worker's request number (claim.lua),
--   complete and release by the lease (`ended_by`), log by the call's number (`log_n`), enqueue by
--   the job id and spec, enqueue_many by its batch key.
--
-- * Memory. With `maxmemory` reached (the pool's Redis runs `noeviction`), Redis refuses a script's
--   first write command if that command may allocate, and lets every later write of a script that
--   has already written go through (a script is never cut in half). The first write therefore
--   decides, and is chosen on purpose: scripts that grant or add something (claim, enqueue, log,
--   heartbeat) write an allocating command first and are refused whole, so at the memory limit no
--   new lease, job or output is taken in; scripts that end, take back or only extend (complete,
--   release, reclaim, cancel, renew) start with a deletion and go on working: running jobs keep
--   their leases, and ending jobs is how the pool gets its memory back. A worker whose heartbeat
--   is refused claims nothing (worker/claim_gate.py).

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

-- Fair share (claim.lua): a queue whose claims rank users by recent use keeps, in its `fairshare`
-- hash, the half-life its claimers decay use by ('half_life', ms) and each user's use at a time
-- ('u:USER', GPU-ms; 't:USER', ms). A job counts as one GPU when it holds none, so CPU jobs share
-- fairly too. `decayed` is a user's stored use as of `now`: halved every half-life since it was
-- stored.
local function decayed(fs, user, now, half)
  local u = redis.call('HMGET', fs, 'u:' .. user, 't:' .. user)
  if not u[1] then return 0 end
  return tonumber(u[1]) * 2 ^ (-(now - tonumber(u[2])) / half)
end

-- Charge the attempt ending now to its user's use, from when it started ('ran_from': its claim,
-- or for one claimed ahead of a free slot when its worker said it started, started.lua), in a
-- fair-share queue (no-op elsewhere: a queue whose claimers never ranked by use has no
-- half-life, and for an attempt claimed ahead that never started).
local function charge(prefix, jobkey, now)
  local fs = prefix .. 'fairshare'
  local half = tonumber(redis.call('HGET', fs, 'half_life'))
  if not half then return end
  local j = redis.call('HMGET', jobkey, 'user', 'held_gpus', 'started_at', 'ahead', 'ran_from')
  if not j[1] or not j[3] or j[4] == '1' then return end  -- (claimed ahead, never started: nothing used)
  local from = tonumber(j[5]) or tonumber(j[3])  -- its start; for a record of before 'ran_from', its claim
  local used = math.max(1, tonumber(j[2]) or 0) * math.max(0, now - from)
  redis.call('HSET', fs, 'u:' .. j[1], string.format('%.0f', decayed(fs, j[1], now, half) + used),
    't:' .. j[1], now)
end

-- Close the newest attempt in a job's history, if it is still open, and charge its use.
local function close_attempt(prefix, jobkey, how, now)
  charge(prefix, jobkey, now)
  local hist = jobkey .. ':attempts'
  local last = redis.call('LINDEX', hist, -1)
  if last then
    local a = cjson.decode(last)
    if a.how == 'running' then
      a.how = how
      a.ended_at = now
      redis.call('LSET', hist, -1, cjson.encode(a))
    end
  end
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

-- How many finished jobs of a queue to forget per job that finishes, once past retention: the
-- index stays bounded by the jobs of the last `retention` seconds at a constant cost per finish.
local TRIM_PER_FINISH = 8

-- Arrays (`poolctl enqueue --array 0-99%N`): the jobs of array QUEUE@NAME are in its queue's
-- `array:NAME` (ZSET id -> place), the record the commands that take the array's id read. With a
-- window N (the record's 'window'), at most N of them are in the queue at once, queued or
-- running, as Slurm's %N counts an array's running tasks: `array:NAME:active` (SET) holds those
-- let in and not ended; `array:NAME:next` (ZSET id -> place) those whose turn it is once a place
-- frees, which `admit` lets in lowest place first. `array:NAME:left` counts the array's jobs not
-- ended: the array's keys live while it is above 0, and expire with the retention once it is 0.
local function array_key(prefix, array)
  return prefix .. 'array:' .. string.match(array, '@(.+)$')
end

-- A job held out of its queue (in `waiting`) joins it, at its tail: its stream entry is added,
-- and with a priority its place in `prio`, so that workers see it as any new job.
local PRIO_MAX, PRIO_SEQ = 100, 4294967296
local function join(prefix, jobkey, id, priority, seq)
  local entry = redis.call('XADD', prefix .. 'stream', '*', 'job', id)
  redis.call('ZREM', prefix .. 'waiting', id)
  redis.call('HSET', jobkey, 'entry', entry)
  if priority > 0 then
    redis.call('ZADD', prefix .. 'prio', (PRIO_MAX - priority) * PRIO_SEQ + seq, id)
  end
end

-- Let the array's next jobs into the queue while fewer than `window` of it are under way.
local function admit(prefix, array, window)
  local key = array_key(prefix, array)
  while redis.call('SCARD', key .. ':active') < window do
    local nxt = redis.call('ZPOPMIN', key .. ':next')
    if not nxt[1] then return end
    local jobkey = job_key(prefix, nxt[1])
    local j = redis.call('HMGET', jobkey, 'state', 'priority', 'seq')
    if j[1] == 'queued' and redis.call('ZSCORE', prefix .. 'waiting', nxt[1]) then
      join(prefix, jobkey, nxt[1], tonumber(j[2]) or 0, tonumber(j[3]))
      redis.call('SADD', key .. ':active', nxt[1])
    end
  end
end

-- A held job of an array with a window, nothing else to wait for: it takes its turn (by its
-- place) for a place in the window, and the array's next jobs go in while there is room.
local function take_turn(prefix, id, array, pos, window)
  redis.call('ZADD', array_key(prefix, array) .. ':next', pos, id)
  admit(prefix, array, window)
end

-- Job `id` of `array` ended: its place in the window frees for the next job; the array's last
-- job to end starts the retention countdown of the array's keys.
local function array_ended(prefix, array, window, id, retention)
  local key = array_key(prefix, array)
  redis.call('SREM', key .. ':active', id)
  redis.call('ZREM', key .. ':next', id)
  if redis.call('DECR', key .. ':left') <= 0 then
    for _, k in ipairs({key, key .. ':active', key .. ':next', key .. ':left'}) do
      redis.call('EXPIRE', k, retention)
    end
  end
  if window > 0 then admit(prefix, array, window) end
end

-- The fields of a job's record that `finish` reads, in this order (a caller that read them
-- already passes them on).
local FINISH_FIELDS = {'entry', 'idem', 'enqueued_at', 'started_at', 'array', 'window', 'user', 'counted'}

-- What each user has in a queue and has not ended, queued or running (issue 44 item 6): the
-- queue's `unended` HASH (user -> count), one more as `add_job` adds a job, one less as `finish`
-- ends one, in the scripts that do so, so it is exact: a requeue, a reclaim, a retry or an
-- array's or a dependency's wait moves a job between states that all count, and every end of a
-- job, however it comes, is `finish`, which runs once per job. The enqueue scripts refuse a
-- job that would take its user past their bound, in the same call, so concurrent enqueues
-- cannot pass it together. A job counted says so on its record ('counted'): one enqueued
-- before the count was kept was never counted, and its end takes nothing away. A user at 0
-- leaves the hash.
local function unended(prefix, user)
  return tonumber(redis.call('HGET', prefix .. 'unended', user)) or 0
end

local function uncount(prefix, user)
  local key = prefix .. 'unended'
  if redis.call('HINCRBY', key, user, -1) <= 0 then redis.call('HDEL', key, user) end
end

-- Webhooks (daemon/server/notifier.py): a job whose end is to be notified names, on its record,
-- the targets it goes to ('notify': 'job' for its --notify URL, 'pool' for notify_url, or both,
-- space-separated; written when it is enqueued). Its end puts one entry per target in the
-- queue's `outbox` (ZSET 'ID/TARGET' -> when it is due, ms), in the script that ends the job, so
-- no crash comes between an end and its notification; servers take them on (outbox_take.lua).
-- At OUTBOX_MAX entries the one due longest ago makes room, counted in `outbox_dropped` for a
-- server to report: a receiver down for long cannot grow the outbox without bound.
local OUTBOX_MAX = 100000
local function to_outbox(prefix, jobkey, id, now)
  local targets = redis.call('HGET', jobkey, 'notify')
  if not targets then return end
  local outbox = prefix .. 'outbox'
  for target in string.gmatch(targets, '%a+') do
    redis.call('ZADD', outbox, 'NX', now, id .. '/' .. target)
  end
  local over = redis.call('ZCARD', outbox) - OUTBOX_MAX
  if over > 0 then
    redis.call('ZPOPMIN', outbox, over)
    redis.call('INCRBY', prefix .. 'outbox_dropped', over)
  end
end

-- Move a job to a terminal state: the record (with `fields`, more field-value pairs to set at
-- once, if given), the stream entry, its notifications (to_outbox), an event for waiters, and
-- the retention countdown of every key of the job (the set of the jobs waiting for it too); the
-- next jobs of its array's window are let in; the queue's index forgets jobs past retention.
-- `j`: the job's FINISH_FIELDS, when the caller has read them.
local function finish(prefix, stream, group, events, id, state, now, retention, j, fields)
  local jobkey = job_key(prefix, id)
  j = j or redis.call('HMGET', jobkey, unpack(FINISH_FIELDS))
  drop_entry(stream, group, j[1])
  local set = {'state', state, 'ended_at', now}
  for _, v in ipairs(fields or {}) do set[#set + 1] = v end
  redis.call('HSET', jobkey, unpack(set))
  to_outbox(prefix, jobkey, id, now)
  -- the times ride along so that whoever reads events (metrics) needs no second round trip
  redis.call('XADD', events, 'MAXLEN', '~', 10000, '*', 'job', id, 'state', state,
    'enqueued_at', j[3] or '', 'started_at', j[4] or '', 'ended_at', now)
  for _, k in ipairs({jobkey, jobkey .. ':attempts', jobkey .. ':log'}) do
    redis.call('EXPIRE', k, retention)
  end
  if j[2] then redis.call('EXPIRE', j[2], retention) end
  redis.call('EXPIRE', prefix .. 'dependents:' .. id, retention)  -- kept while the job lived
  if j[5] and j[5] ~= '' then array_ended(prefix, j[5], tonumber(j[6]) or 0, id, retention) end
  if j[8] == '1' then uncount(prefix, j[7] or '') end
  local ended, index = prefix .. 'ended', prefix .. 'jobs'
  redis.call('ZADD', ended, now, id)
  if redis.call('EXISTS', prefix .. 'capped') == 1 then wake(prefix) end  -- a cap may have room now
  local old = redis.call('ZRANGEBYSCORE', ended, '-inf', now - retention * 1000, 'LIMIT', 0, TRIM_PER_FINISH)
  if #old > 0 then
    redis.call('ZREM', ended, unpack(old))
    redis.call('ZREM', index, unpack(old))
  end
end

-- Caps per user (claim.lua): a queued job whose user is at a cap is held aside, in the queue's
-- `capped` ZSET and its user's `capped:USER` (both by seq); `capped_users` lists each such user
-- (scored no later than their oldest held job's seq), so a claim finds the oldest held job of a
-- user below the cap with one look per user, however many jobs the others have held.
-- `listed`: the caller knows `user` is in capped_users with a seq no later than this one.
-- `front`: held from the front in a fair-share queue, where the users' lines hold every waiting job:
-- it is also in `capped_front`, marked 'front' on its record, and goes first (claim/front.lua).
local function hold(prefix, user, id, seq, listed, front)
  if front then
    redis.call('ZADD', prefix .. 'capped_front', seq, id)
    redis.call('HSET', job_key(prefix, id), 'front', '1')
  end
  redis.call('ZADD', prefix .. 'capped', seq, id)
  redis.call('ZADD', prefix .. 'capped:' .. user, seq, id)
  if not listed then redis.call('ZADD', prefix .. 'capped_users', 'LT', seq, user) end
end

-- Returns the user's oldest held job left, {id, seq} ({} when none). A user's score in
-- capped_users is left as it was while they hold jobs: no later than their oldest held job's seq,
-- which is all a claim needs of it (it reads each user's line itself), at one write less a start.
local function unhold(prefix, user, id)
  if redis.call('ZREM', prefix .. 'capped', id) == 0 then return {} end
  redis.call('HDEL', job_key(prefix, id), 'front')  -- (claim/front.lua: held from the front)
  redis.call('ZREM', prefix .. 'capped_front', id)
  local mine = prefix .. 'capped:' .. user
  redis.call('ZREM', mine, id)
  local top = redis.call('ZRANGE', mine, 0, 0, 'WITHSCORES')
  if not top[1] then redis.call('ZREM', prefix .. 'capped_users', user) end
  return top
end

-- Put a job at the front of its queue (`front`, keys.py): served before the stream, in enqueue order; its
-- entry stays pending (owned by the 'reclaimed' consumer) so it is never trimmed.
local function to_front(prefix, stream, group, front, id)
  local j = redis.call('HMGET', job_key(prefix, id), 'seq', 'entry')
  redis.call('ZADD', front, j[1], id)
  redis.call('XCLAIM', stream, group, 'reclaimed', 0, j[2], 'JUSTID')
end

-- A started job queued again, its attempt over: to be claimed with attempt+1.
local function unstarted(prefix, id)
  redis.call('HSET', job_key(prefix, id), 'state', 'queued', 'worker', '')
  redis.call('HDEL', job_key(prefix, id), 'requeue')  -- asked for (requeue.lua), and done
end

-- Put a started job back at the front of its queue, to be claimed again with attempt+1.
local function requeue(prefix, stream, group, front, id)
  unstarted(prefix, id)
  to_front(prefix, stream, group, front, id)
  wake(prefix)
end

-- A failed job with retries left (complete.lua), its `failures` counted already: back to the
-- front at once with no back-off (`base` 0), else after `base` ms doubled for each failure before
-- this one, at most `most`: queued meanwhile in `backoff` (scored by when it is due), its entry
-- pending under 'reclaimed' as a front job's, where no claim looks; the reaper's pass
-- (reclaim.lua) puts it at the front once due.
local function retry_after(prefix, stream, group, front, id, failures, base, most, now)
  if base <= 0 then return requeue(prefix, stream, group, front, id) end
  unstarted(prefix, id)
  redis.call('ZADD', prefix .. 'backoff', now + math.min(base * 2 ^ (failures - 1), most), id)
  redis.call('XCLAIM', stream, group, 'reclaimed', 0, redis.call('HGET', job_key(prefix, id), 'entry'), 'JUSTID')
end

-- Take `n` sequence numbers of a queue, creating its stream and consumer group the first time.
-- Returns the first of them.
local function reserve(stream, seqkey, group, n)
  if redis.call('EXISTS', stream) == 0 then
    redis.call('XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM')
  end
  return redis.call('INCRBY', seqkey, n) - n + 1
end

-- Priorities: a job enqueued with priority P > 0 is also in its queue's `prio` ZSET, scored so
-- that the highest priority, then the lowest seq, comes first; claims take it before the stream
-- (claim.lua). PRIO_SEQ (above, with `join`) exceeds any seq a queue will reach.

-- What an enqueue script is given of each job, in this order in its ARGV (job_queue.py
-- `_job_args` writes them so): its spec (msgpack, opaque to every script), the GPUs it wants, its
-- max attempts and retries, its priority (0: none), its user (whose caps it counts against), the
-- bytes it asks for on one shared GPU (0: whole GPUs), what it waits for ("JOB:how ...",
-- daemon/after.py; '' for nothing), its array ('QUEUE@NAME'; '' for none), its place in it, the
-- array's window (the most of it under way at once; 0: no limit), where its end is notified
-- ('job', 'pool', both space-separated, or '': to_outbox), its time limit (ms; 0: none) and its
-- own stop grace (ms; -1: the worker's). The scheduler reads what it needs of a job from these
-- named fields of its record (claim/job.lua), never from the spec.
local JOB_ARGS = {'spec', 'gpus', 'max_attempts', 'retries', 'priority', 'user', 'gpu_mem_bytes', 'after', 'array',
  'array_pos', 'window', 'notify', 'time_limit_ms', 'stop_grace_ms'}

-- The job given at ARGV[first] and on, as a table keyed by JOB_ARGS.
local function job_args(argv, first)
  local a = {}
  for i, name in ipairs(JOB_ARGS) do a[name] = argv[first + i - 1] end
  return a
end

-- Add a job (`a`: job_args) at the tail of its queue with sequence number `seq` (from reserve):
-- its record and index entry, and its place in its array. The caller has made sure its id is
-- free. A job that waits for others to end (`a.after`) is held in `waiting`, with what it waits
-- for on its record, and listed in `depends`, where the server's judge finds it, till ready.lua;
-- one of an array with a window goes in its turn (`take_turn`); any other joins the queue at once. All in the one call, so
-- no crash leaves a job held with nothing to say what it waits for.
local function add_job(prefix, index, jobkey, id, seq, now, a)
  local priority, pos, window = tonumber(a.priority) or 0, tonumber(a.array_pos) or 0, tonumber(a.window) or 0
  redis.call('HSET', jobkey, 'id', id, 'state', 'queued', 'seq', seq, 'attempt', 0, 'spec', a.spec,
    'gpus', a.gpus, 'max_attempts', a.max_attempts, 'retries', a.retries, 'failures', 0, 'losses', 0,
    'enqueued_at', now, 'entry', '', 'priority', priority, 'user', a.user or '',
    'gpu_mem_bytes', tonumber(a.gpu_mem_bytes) or 0, 'time_limit_ms', tonumber(a.time_limit_ms) or 0,
    'stop_grace_ms', tonumber(a.stop_grace_ms) or -1,
    'after', a.after or '', 'array', a.array or '', 'array_pos', pos, 'window', window, 'counted', 1)
  if a.notify and a.notify ~= '' then redis.call('HSET', jobkey, 'notify', a.notify) end
  redis.call('ZADD', index, seq, id)
  redis.call('HINCRBY', prefix .. 'unended', a.user or '', 1)
  if a.array and a.array ~= '' then
    local key = array_key(prefix, a.array)
    redis.call('ZADD', key, pos, id)
    redis.call('INCR', key .. ':left')
    redis.call('PERSIST', key)  -- (an earlier batch of it may have ended, and set it expiring)
    redis.call('PERSIST', key .. ':left')
  end
  if a.after and a.after ~= '' then
    redis.call('ZADD', prefix .. 'waiting', seq, id)
    redis.call('ZADD', prefix .. 'depends', seq, id)  -- what the server's sweep judges
  elseif window > 0 then
    redis.call('ZADD', prefix .. 'waiting', seq, id)
    take_turn(prefix, id, a.array, pos, window)
  else
    join(prefix, jobkey, id, priority, seq)
  end
end
