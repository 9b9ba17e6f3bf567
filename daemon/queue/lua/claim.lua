-- claim: hand up to N next jobs of one queue to a worker, as leases.
-- Guarantees (atomic, so under any number of concurrent claimers):
--  * one holder: a job is popped from `retry` or delivered by the consumer group, each of which
--    happens once, and it becomes running with attempt+1 under this worker, with a lease deadline
--    and a lease id that no other claim ever gets (the worker's id, its request number, an index);
--  * order: jobs at the front (`retry`: reclaimed, handed back, retried; and the `parked` jobs this
--    worker can hold) go before any job not yet started, lowest enqueue seq first; then jobs with
--    a priority (`prio`), the highest first, the lowest seq among equals (each leaves the stream
--    as it is claimed: its entry is deleted undelivered, so the stream never offers it again);
--    then stream entries, strictly in enqueue order. A priority job's place is its priority's:
--    it heads the line, and waits for GPUs at its head as the stream's first entry would. Head of line: when the next job needs more GPUs than the claimer
--    has free (less what this call already handed out), claiming stops there and that job waits
--    for them. A job that needs more GPUs than the claimer has at all can never run there and
--    never blocks it: it is passed over, still queued, into `parked`, where only workers big
--    enough look, oldest first. A job asking for 0 GPUs needs the claimer's default (its slot's
--    share of the worker's GPUs);
--  * the attempt number rises on every claim;
--  * once per request: the worker numbers its claims; a request it sends again (its reply was
--    lost) answers the same leases, still unexpired and renewed from now, without claiming more,
--    and an older request arriving late claims nothing (the worker's memo, one small key per
--    worker and queue, lives one lease);
--  * caps per user (ARGV 10, 11; 0: none): a job whose user already runs that many jobs, or would
--    hold more than that many GPUs, in this queue is held aside (`capped`, by seq) rather than
--    started or waited for, and the jobs behind it go on; it returns to the front, by its seq,
--    once its user is below the caps (counted from the queue's leases at each call, so nothing
--    kept apart can drift). A user with nothing running here always gets one job, however big;
--  * fair share (ARGV 12, a half-life in ms; 0: FIFO): the stream's entries join their users'
--    lines (`capped:USER`, by seq) as they are read, and after the front and the priorities the
--    next start goes to the user with the least recent use per weight (their decayed use, see
--    _lib.lua `charge`, plus what their running jobs here used so far, each counted as at least
--    one GPU-ms, so that a burst of starts alternates; the weight is the queue's
--    `fairshare` 'w:USER', 1 by default), then to the user with fewer jobs running, then to the
--    older job; FIFO within one user. The chosen job waits for GPUs at the head as a stream entry
--    would. A job from the front held at its user's cap waits in their line marked 'front', and
--    goes before every line once they are below it, as the front does;
--  * backfill with a reservation (ARGV 13, 14): the first job that must wait for GPUs here (the
--    head) reserves this worker (`reservation`: one per queue, for a lease, renewed by each claim
--    of its worker; a worker that dies lets it lapse), unless another live worker holds its
--    reservation. Jobs behind it may then start: on any worker the head is not reserved on; on the
--    one it is, only a job whose time limit (plus stop grace) ends before the head could start
--    there (the running jobs' limits say when: one without a limit may end any moment). So no job
--    it waits behind can delay it, and it starts once its reserved worker has its GPUs. A worker holding a reservation keeps those GPUs from the
--    queues it claims from after this one too (ARGV 15);
--  * preemption (ARGV 16, where an admin enables it for the queue): a job with a priority that
--    must wait for GPUs on this worker, which holds its reservation, asks this worker's running
--    jobs of lower priority in the queue to stop and be handed back (the lowest priority first,
--    the latest started first among equals; the flag renew.lua answers 'preempt' to), as few as
--    make room; the reservation is marked so, and this worker's next claims start that job before
--    anything else, and nothing that could delay it meanwhile. A claim for no job (N = 0: the
--    worker's slots are all taken) only looks whether the queue's highest-priority job should
--    preempt here, and then asks for a slot as well. Answered 'preempting';
--  * GPU memory (ARGV 17, 18): a job asking for memory on one shared GPU (`gpu_mem`, MiB) goes on
--    a GPU of the worker's table with room for it (its memory left and fewer jobs than the cap):
--    one already shared, the fullest that fits (so shared jobs pack and leave GPUs whole), else a
--    GPU free whole, which is then no longer free for a job of whole GPUs; a GPU held whole is
--    never in the table. It counts as one GPU towards caps and fair share. One asking for more
--    than the worker's largest GPU is passed over, as a job of more GPUs than the worker has;
--  * a pilot's end (ARGV 19): a worker with one never gets a job that could run past it, on any
--    path above: one whose time limit and stop grace end later, or one with no time limit at all.
--    Such a job is passed over, still queued (never waited for: no reservation, no preemption for
--    it), and a preempting reservation this worker holds for a job that no longer fits its time
--    left is dropped, keeping no GPUs for it;
--  * one user's worker (ARGV 21: a worker not running as root, which runs every job as its own
--    user, serves that pool user only: docs/DESIGN.md): another user's job is never claimed
--    there, and is passed over exactly as a job that would outlive a pilot is (above), so it
--    never holds that worker's own user's jobs back;
--  * at maxmemory the claim is refused whole: its first write is the memo (see _lib.lua);
--  * cancelled jobs met on the way are acknowledged and deleted, never run.
-- KEYS: 1 stream, 2 retry, 3 leases, 4 the worker's claim memo, 5 parked
-- ARGV: 1 queue key prefix, 2 group, 3 consumer (worker id), 4 GPUs free, 5 lease duration (ms),
--       6 GPUs a job asking for 0 gets, 7 most jobs to claim, 8 GPUs the worker has in all,
--       9 request number (rises with every new request of this worker), 10 most jobs a user may
--       run in this queue, 11 most GPUs a user may hold in it (0: no cap), 12 fair share's
--       half-life (ms; 0: FIFO), 13 when the worker's running jobs end at the latest ('MS:GPUS ...',
--       ms from now; -1: no time limit), 14 its stop grace (ms), 15 GPUs it keeps for a head job
--       reserved on it in a queue it claimed from before this one (0: none), 16 '1' where a job
--       with a priority may preempt lower ones, 17 the GPUs that can take a shared job ('N:MIB:JOBS:S
--       ...': the GPU's place in the worker's list, MiB it has left, jobs it may take yet, S 1 when
--       shared already, 0 when free whole), 18 MiB of the worker's largest GPU, 19 the worker's
--       lifetime left (ms; 0: none): a job whose time limit runs past it, or that has none, is
--       passed over, 20 how many of the N go to slots free now (the rest are claimed ahead of a
--       free slot, look_ahead.py: each is marked 'ahead' on its record till its worker says it
--       started, started.lua, so that one never started is taken back as no loss, reclaim.lua;
--       and none is taken from the front, where the claim stops instead; default N), 21 the one
--       user whose jobs this worker may run ('': any user's)
-- Returns {status, stream cursor, wake cursor, GPUs kept, shared GPUs (as ARGV 17, as this call
-- left them), id, attempt, lease, spec, shared GPU, ...}: the claimed jobs (each with the place of
-- its shared GPU in the worker's list, -1 for whole GPUs), and why claiming stopped: 'claimed' (N jobs, or a request
-- answered again), 'empty' (nothing more), 'blocked' (the next job needs more GPUs than are
-- free) or 'preempting' (blocked, and jobs here were asked to make room for it). The cursors are the stream ids to wait after (XREAD BLOCK on the stream and the `wake`
-- stream) before a claim can find more; GPUs kept: for a head job reserved on this worker (ARGV
-- 15 of its claims from later queues).
local stream, retry, leases, memo, parked = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local prefix, group, consumer = ARGV[1], ARGV[2], ARGV[3]
local gpus_free, lease_ms = tonumber(ARGV[4]), tonumber(ARGV[5])
local default_gpus, wanted, gpus_total = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local request = tonumber(ARGV[9])
local max_running, max_gpus = tonumber(ARGV[10]) or 0, tonumber(ARGV[11]) or 0
local half_life = tonumber(ARGV[12]) or 0
local ends = {}  -- {ms from now, GPUs} of each running job here, the soonest first
for ms, g in string.gmatch(ARGV[13] or '', '(%-?%d+):(%d+)') do ends[#ends + 1] = {math.max(0, tonumber(ms)), tonumber(g)} end
table.sort(ends, function(a, b) return a[1] < b[1] end)
local grace_ms = tonumber(ARGV[14]) or 0
local preempts = ARGV[16] == '1'
local rooms = {}  -- {place, MiB left, jobs it may take yet, shared already} of each GPU in the table
for n, mib, jobs, shared in string.gmatch(ARGV[17] or '', '(%d+):(%d+):(%d+):([01])') do
  rooms[#rooms + 1] = {tonumber(n), tonumber(mib), tonumber(jobs), shared == '1'}
end
local mem_most = tonumber(ARGV[18]) or 0
local slots = tonumber(ARGV[20]) or wanted
local now = now_ms()
local claimed, ids = {}, {}

local function lease_of(i)
  return consumer .. '/' .. request .. '.' .. i
end

-- The cursors matter only to a claimer that found nothing more to take (it waits after them):
-- a 'claimed' answer carries none.
local head_need, head_at = nil, nil  -- a head job's GPUs kept here, and when it could start (ms)
local function reply(status, cursor)
  local left = {}
  for _, r in ipairs(rooms) do left[#left + 1] = r[1] .. ':' .. r[2] .. ':' .. r[3] .. ':' .. (r[4] and 1 or 0) end
  local out = {status, cursor, '0-0', head_need or 0, table.concat(left, ' ')}
  if status ~= 'claimed' then
    local top = redis.call('XREVRANGE', prefix .. 'wake', '+', '-', 'COUNT', 1)[1]
    out[3] = top and top[1] or '0-0'
  end
  for _, v in ipairs(claimed) do out[#out + 1] = v end
  return out
end

local function add(id, jobkey)
  local j = redis.call('HMGET', jobkey, 'attempt', 'lease', 'spec', 'shared_gpu')
  for _, v in ipairs({id, j[1], j[2], j[3], j[4] or -1}) do claimed[#claimed + 1] = v end
end

-- What a claim reads of a job: its state, the GPUs it asks for, its attempt so far, its spec,
-- its user, its seq, its priority, its stream entry, the MiB it asks for on a shared GPU.
local function job_fields(jobkey)
  return redis.call('HMGET', jobkey, 'state', 'gpus', 'attempt', 'spec', 'user', 'seq', 'priority', 'entry',
    'gpu_mem')
end

-- The same request again: answer the leases it got that are still this worker's and unexpired,
-- each renewed from now (the worker counts its deadline from this call).
local seen = redis.call('HMGET', memo, 'request', 'jobs')
if seen[1] and tonumber(seen[1]) >= request then
  if tonumber(seen[1]) == request then
    local i = 0
    for id in string.gmatch(seen[2], '%S+') do
      i = i + 1
      local jobkey = job_key(prefix, id)
      local j = redis.call('HMGET', jobkey, 'state', 'worker', 'lease')
      local until_ms = tonumber(redis.call('ZSCORE', leases, id))
      if j[1] == 'running' and j[2] == consumer and j[3] == lease_of(i) and until_ms and until_ms > now then
        redis.call('ZADD', leases, 'XX', now + lease_ms, id)
        add(id, jobkey)
      end
    end
  end
  return reply('claimed', '0-0')
end
redis.call('HSET', memo, 'request', request, 'jobs', '')
redis.call('PEXPIRE', memo, lease_ms)

-- The GPUs a job needs here: what it asks for (job_fields' second), or the claimer's default.
local function need_of(f)
  local mem = tonumber(f[9]) or 0
  if mem > 0 then return mem <= mem_most and 1 or gpus_total + 1 end  -- one shared GPU
  local want = tonumber(f[2]) or 0
  if want == 0 then want = default_gpus end
  return want
end

-- The GPU a job asking for `mem` MiB would go on here now (see the top); nil when none has room.
local function room_for(mem)
  local best = nil
  for _, r in ipairs(rooms) do
    if r[3] > 0 and r[2] >= mem and (r[4] or gpus_free > 0) then
      if not best or (r[4] and not best[4]) or (r[4] == best[4] and r[2] < best[2]) then best = r end
    end
  end
  return best
end

-- Whether a job (job_fields `f`) needing `gpus` GPUs (need_of) fits this worker's GPUs now.
local function fits_now(gpus, f)
  local mem = tonumber(f[9]) or 0
  if mem > 0 then return room_for(mem) ~= nil end
  return gpus <= gpus_free
end

local function need(jobkey)
  return need_of(job_fields(jobkey))
end

local function newest()
  local top = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)[1]
  return top and top[1] or '0-0'
end

-- Start job `id` under this claimer; `f`: its job_fields, read in this call.
-- What each user runs in this queue now, {jobs, GPUs, GPU-ms used so far (each job at least
-- one GPU-ms)}: counted from the leases at the first look a call needs (with caps or fair
-- share), then kept up to date by `start`.
local usage = nil
local function use_of(user)
  if not usage then
    usage = {}
    for _, id in ipairs(redis.call('ZRANGE', leases, 0, -1)) do
      local j = redis.call('HMGET', job_key(prefix, id), 'user', 'held_gpus', 'started_at')
      if j[1] then
        local u = usage[j[1]] or {0, 0, 0}
        local g = tonumber(j[2]) or 0
        u[1], u[2] = u[1] + 1, u[2] + g
        u[3] = u[3] + math.max(1, g) * math.max(1, now - (tonumber(j[3]) or now))
        usage[j[1]] = u
      end
    end
  end
  usage[user] = usage[user] or {0, 0, 0}
  return usage[user]
end

-- Whether `user` may start one more job of `gpus` GPUs in this queue.
local function under_cap(user, gpus)
  if (max_running == 0 and max_gpus == 0) or not user or user == '' then return true end
  local u = use_of(user)
  if u[1] == 0 then return true end  -- one job always: no cap can starve a user
  return (max_running == 0 or u[1] < max_running) and (max_gpus == 0 or u[2] + gpus <= max_gpus)
end

local function start(id, jobkey, gpus, f)
  local mem, place = tonumber(f[9]) or 0, -1
  if mem > 0 then  -- on a shared GPU (the caller made sure one has room: fits_now)
    local r = room_for(mem)
    if not r[4] then gpus_free, r[4] = gpus_free - 1, true end  -- no longer free whole
    r[2], r[3], place = r[2] - mem, r[3] - 1, r[1]
  else
    gpus_free = gpus_free - gpus
  end
  ids[#ids + 1] = id
  local lease = lease_of(#ids)
  local attempt = (tonumber(f[3]) or 0) + 1
  redis.call('HSET', jobkey, 'attempt', attempt, 'state', 'running', 'worker', consumer, 'started_at', now,
    'ran_from', now, 'lease', lease, 'log_n', 0, 'held_gpus', gpus, 'shared_gpu', place)
  if #ids > slots then redis.call('HSET', jobkey, 'ahead', '1') end  -- till started.lua
  if usage and f[5] then
    local u = use_of(f[5])
    u[1], u[2], u[3] = u[1] + 1, u[2] + gpus, u[3] + math.max(1, gpus)
  end
  redis.call('ZADD', leases, now + lease_ms, id)
  redis.call('RPUSH', jobkey .. ':attempts',
    cjson.encode({attempt = attempt, worker = consumer, started_at = now, how = 'running', lease = lease}))
  for _, v in ipairs({id, attempt, lease, f[4], place}) do claimed[#claimed + 1] = v end
end

local function stop(status, cursor)
  redis.call('HSET', memo, 'jobs', table.concat(ids, ' '))
  return reply(status, cursor)
end

-- Pass a job over for a worker big enough for it: queued, in `parked`, scored GPUs * SEQ + seq,
-- so that a claimer finds the oldest job it can hold with one look per GPU count present.
local SEQ = 4294967296
local function park(id, gpus)
  local seq = tonumber(redis.call('HGET', job_key(prefix, id), 'seq'))
  redis.call('ZADD', parked, gpus * SEQ + seq, id)
  wake(prefix)
end

-- The oldest parked job this worker can hold, and its seq (nil when there is none).
local function oldest_parked()
  local best, best_seq, from = nil, nil, '-inf'
  local upto = '(' .. string.format('%d', (gpus_total + 1) * SEQ)
  while true do
    local p = redis.call('ZRANGEBYSCORE', parked, from, upto, 'WITHSCORES', 'LIMIT', 0, 1)
    if not p[1] then return best, best_seq end
    local score = tonumber(p[2])
    local g = math.floor(score / SEQ)
    if not best_seq or score - g * SEQ < best_seq then best, best_seq = p[1], score - g * SEQ end
    from = string.format('%d', (g + 1) * SEQ)  -- the next GPU count present
  end
end

-- The oldest job held at a cap that this worker can hold and whose user is below the caps now,
-- its seq and its user; nil when there is none. A look per user holding jobs, at their oldest
-- HELD_LOOK held jobs: one too big for this worker or for the GPU cap does not hide the others.
local capped_users = prefix .. 'capped_users'
local HELD_LOOK = 20
local function oldest_released()
  if redis.call('EXISTS', capped_users) == 0 then return nil end
  local best, best_seq, best_user = nil, nil, nil
  for _, user in ipairs(redis.call('ZRANGE', capped_users, 0, -1)) do
    local held = redis.call('ZRANGE', prefix .. 'capped:' .. user, 0, HELD_LOOK - 1, 'WITHSCORES')
    for i = 1, #held, 2 do
      local seq = tonumber(held[i + 1])
      if best_seq and seq >= best_seq then break end
      local g = need(job_key(prefix, held[i]))
      if g <= gpus_total and under_cap(user, g) then
        best, best_seq, best_user = held[i], seq, user
        break
      end
    end
  end
  return best, best_seq, best_user
end

-- Backfill (see the top). When `g` GPUs could be free here at the earliest (ms from now): the
-- running jobs end at their limits, and GPUs in use that `ends` does not account for (jobs
-- without a limit, jobs claimed in this very call) may come back any moment.
local function earliest(g)
  local free = gpus_total
  for _, e in ipairs(ends) do free = free - e[2] end
  if free >= g then return 0 end
  for _, e in ipairs(ends) do
    free = free + e[2]
    if free >= g then return e[1] end
  end
  return 0
end

-- The longest a job (its packed spec) may run here, in ms: its time limit and stop grace; nil
-- when it has no limit.
local function run_limit(spec)
  local ok, s = pcall(cmsgpack.unpack, spec)
  if not ok or type(s) ~= 'table' or type(s.timeout) ~= 'number' then return nil end
  return s.timeout * 1000 + (type(s.stop_grace) == 'number' and s.stop_grace * 1000 or grace_ms)
end

-- Whether a job (job_fields `f`) is not for this claimer: it could run past the claimer's own end
-- (ARGV 19: a pilot worker's lifetime left, ms; 0: none), its time limit and stop grace ending
-- later or it having no time limit at all; or it is another user's than the one this claimer
-- serves (ARGV 21). Such a job is passed over, never waited for, and nothing is stopped for it.
local lifetime = tonumber(ARGV[19]) or 0
local serves = ARGV[21] or ''
local function passed_over(f)
  if serves ~= '' and f[5] ~= serves then return true end
  if lifetime <= 0 then return false end
  local limit = run_limit(f[4])
  return limit == nil or limit > lifetime
end

-- Whether a job of `gpus` GPUs (job_fields `f`) may start here now: its GPUs are free, it ends
-- before this worker does, and with a head job's GPUs kept here, it is sure to end before the
-- head could start.
local function may_start(gpus, f)
  if not fits_now(gpus, f) or passed_over(f) then return false end
  if not head_need then return true end
  local limit = run_limit(f[4])
  return limit ~= nil and limit <= head_at
end
if tonumber(ARGV[15] or 0) > 0 then head_need = tonumber(ARGV[15]); head_at = earliest(head_need) end

-- The last entry the group delivered: where to wait after when nothing more can be taken.
local function delivered()
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local fields = {}
    for i = 1, #g, 2 do fields[g[i]] = g[i + 1] end
    if fields['name'] == group then return fields['last-delivered-id'] end
  end
  return '0-0'
end

-- Start, behind the head job `head`, the jobs that may start here (may_start), in the order a
-- claim looks: the front, the priorities, the users' lines, the stream's entries not yet delivered
-- (each taken out of turn is deleted undelivered, as a priority job's is). A bounded look.
local LOOK = 50
local function backfill(head)
  local function fits(id)
    if id == head then return nil end
    local jobkey = job_key(prefix, id)
    local f = job_fields(jobkey)
    local g = need_of(f)
    if f[1] == 'queued' and g <= gpus_total and under_cap(f[5], g) and may_start(g, f) then
      return jobkey, f, g
    end
    return nil
  end
  for _, from in ipairs({retry, parked}) do
    for _, id in ipairs(redis.call('ZRANGE', from, 0, LOOK - 1)) do
      if #ids == wanted or #ids >= slots then break end  -- (the front is never claimed ahead)
      local jobkey, f, g = fits(id)
      if jobkey then
        redis.call('ZREM', from, id)
        redis.call('XCLAIM', stream, group, consumer, 0, f[8], 'JUSTID')
        start(id, jobkey, g, f)
      end
    end
  end
  for _, id in ipairs(redis.call('ZRANGE', prefix .. 'prio', 0, LOOK - 1)) do
    if #ids == wanted then return end
    local jobkey, f, g = fits(id)
    if jobkey then
      redis.call('ZREM', prefix .. 'prio', id)
      redis.call('XDEL', stream, f[8])
      start(id, jobkey, g, f)
    end
  end
  for _, user in ipairs(redis.call('ZRANGE', capped_users, 0, LOOK - 1)) do
    for _, id in ipairs(redis.call('ZRANGE', prefix .. 'capped:' .. user, 0, HELD_LOOK - 1)) do
      if #ids == wanted then return end
      local jobkey, f, g = fits(id)
      if jobkey then
        unhold(prefix, user, id)
        redis.call('XCLAIM', stream, group, consumer, 0, f[8], 'JUSTID')
        start(id, jobkey, g, f)
      end
    end
  end
  if redis.call('EXISTS', stream) == 0 then return end
  for _, e in ipairs(redis.call('XRANGE', stream, '(' .. delivered(), '+', 'COUNT', LOOK)) do
    if #ids == wanted then return end
    local id = e[2][1] == 'job' and e[2][2] or nil
    local jobkey, f, g = nil, nil, nil
    if id then jobkey, f, g = fits(id) end
    if jobkey then
      redis.call('XDEL', stream, e[1])
      redis.call('ZREM', prefix .. 'prio', id)
      start(id, jobkey, g, f)
    end
  end
end

-- Job `id`, the first that must wait for its `gpus` here: it reserves this worker unless another
-- live one holds its reservation (or GPUs here are kept for a head already), the jobs behind it
-- that may start do (backfill), and the claim stops.
local reservation = prefix .. 'reservation'

-- Preemption (see the top): ask as few of this worker's running jobs of this queue with a
-- priority below `p` to stop as make room for `gpus` GPUs (and, with `slot`, for a slot too);
-- jobs already asked to stop count as leaving. True when there is room, or will be.
local function preempt(gpus, p, slot)
  local have, leaving, victims = gpus_free, 0, {}
  for _, id in ipairs(redis.call('ZRANGE', leases, 0, -1)) do
    local j = redis.call('HMGET', job_key(prefix, id), 'worker', 'priority', 'held_gpus', 'started_at', 'requeue',
      'cancel', 'seq', 'gpu_mem')
    local g = (tonumber(j[8]) or 0) > 0 and 0 or tonumber(j[3]) or 0  -- a shared GPU's job frees no GPU
    if j[1] == consumer and (j[5] or j[6] == '1') then
      have, leaving = have + g, leaving + 1
    elseif j[1] == consumer and (tonumber(j[2]) or 0) < p then
      victims[#victims + 1] = {id, tonumber(j[2]) or 0, -(tonumber(j[4]) or 0), g, -(tonumber(j[7]) or 0)}
    end
  end
  table.sort(victims, function(a, b)  -- the lowest priority, the latest started, the latest queued
    if a[2] ~= b[2] then return a[2] < b[2] end
    if a[3] ~= b[3] then return a[3] < b[3] end
    return a[5] < b[5]
  end)
  local chosen = {}
  for _, v in ipairs(victims) do
    if have >= gpus and (not slot or leaving + #chosen > 0) then break end
    if v[4] > 0 or (slot and leaving + #chosen == 0) then
      chosen[#chosen + 1] = v[1]
      have = have + v[4]
    end
  end
  if have < gpus or (leaving + #chosen == 0) then return false end  -- no room, or none needed
  for _, id in ipairs(chosen) do redis.call('HSET', job_key(prefix, id), 'requeue', 'preempt') end
  return true
end

-- Job `id`, the first that must wait for its `gpus` here: it reserves this worker unless another
-- live one holds its reservation (or GPUs here are kept for a head already), it may preempt jobs
-- here, the jobs behind it that may start do (backfill), and the claim stops.
local function blocked(id, gpus)
  local status = 'blocked'
  local f = job_fields(job_key(prefix, id))
  if not head_need and not passed_over(f) then
    local r = redis.call('HMGET', reservation, 'job', 'worker', 'until')
    if not (r[1] == id and r[2] ~= consumer and tonumber(r[3]) > now) then
      head_need, head_at = gpus, earliest(gpus)
      redis.call('HSET', reservation, 'job', id, 'worker', consumer, 'until', now + lease_ms, 'at', now + head_at,
        'preempt', '0')
      local p = tonumber(f[7]) or 0  -- (a job on a shared GPU waits for memory: it preempts nobody)
      if preempts and p > 0 and (tonumber(f[9]) or 0) == 0 and preempt(gpus, p, false) then
        redis.call('HSET', reservation, 'preempt', '1')
        status = 'preempting'
      end
    end
  end
  backfill(id)
  return stop(status, newest())
end

-- A job out of whichever place it waits in (the front, parked, held, `prio`), to start it now: a
-- pending entry is claimed by this worker, one never delivered (or acknowledged) is deleted.
local function take_out(id, f)
  local entry, user = f[8], f[5]
  local pending = redis.call('ZREM', retry, id) + redis.call('ZREM', parked, id)
  if redis.call('ZSCORE', prefix .. 'capped', id) then
    unhold(prefix, user or '', id)
    pending = 1
  end
  redis.call('ZREM', prefix .. 'prio', id)
  if pending > 0 then
    redis.call('XCLAIM', stream, group, consumer, 0, entry, 'JUSTID')
  else
    redis.call('XDEL', stream, entry)
  end
end

-- A job that preempted jobs here goes first, as soon as it fits; until then nothing that could
-- delay it starts here (its reservation is renewed by each claim of this worker).
local r = redis.call('HMGET', reservation, 'job', 'worker', 'until', 'preempt')
if r[4] == '1' and r[2] == consumer and tonumber(r[3]) > now then
  local jobkey = job_key(prefix, r[1])
  local f = job_fields(jobkey)
  if f[1] == 'queued' and passed_over(f) then
    -- This pilot's time ran short of it since: nothing is kept for it here any more.
    redis.call('DEL', reservation)
  elseif f[1] == 'queued' then
    local gpus = need_of(f)
    redis.call('HSET', reservation, 'until', now + lease_ms)
    if wanted > 0 and fits_now(gpus, f) and under_cap(f[5], gpus) then
      take_out(r[1], f)
      start(r[1], jobkey, gpus, f)
    elseif not head_need then
      head_need, head_at = gpus, earliest(gpus)
    end
  end
end

-- No job wanted (the worker's slots are all taken): should the queue's highest-priority job
-- preempt jobs here?
if wanted == 0 then
  local status = 'blocked'
  local top = redis.call('ZRANGE', prefix .. 'prio', 0, 0)[1]
  local held = redis.call('HMGET', reservation, 'job', 'worker', 'until')
  if top and held[1] == top and tonumber(held[3]) > now then top = nil end  -- reserved (here or elsewhere)
  if preempts and top and not head_need then
    local jobkey = job_key(prefix, top)
    local f = job_fields(jobkey)
    local gpus = need_of(f)
    local p = tonumber(redis.call('HGET', jobkey, 'priority')) or 0
    if f[1] == 'queued' and gpus <= gpus_total and under_cap(f[5], gpus) and not passed_over(f)
        and (tonumber(f[9]) or 0) == 0 and preempt(gpus, p, true) then
      redis.call('HSET', reservation, 'job', top, 'worker', consumer, 'until', now + lease_ms, 'at', now,
        'preempt', '1')
      status = 'preempting'
    end
  end
  return stop(status, newest())
end

-- Whether anything waits at the front or with a priority: one look for all four places (most
-- claims find none, and each look costs Redis a command on the path to a job's start).
local waiting = redis.call('EXISTS', retry, parked, capped_users, prefix .. 'prio') > 0

-- The front: `retry` (lowest seq first), the parked jobs this worker can hold and the jobs held at
-- a cap whose user is below it now, the oldest first.
local moved = 0
while waiting and #ids < wanted do
  local r = redis.call('ZRANGE', retry, 0, 0, 'WITHSCORES')
  local too_big = r[1] and need(job_key(prefix, r[1])) > gpus_total
  if too_big and moved < 100 then
    redis.call('ZREM', retry, r[1])  -- too big for this worker: parked (its entry stays pending)
    park(r[1], need(job_key(prefix, r[1])))
    moved = moved + 1
  else
    if too_big then return stop('claimed', '0-0') end  -- enough moved for one call: cut short
    local pick, from, pick_seq = r[1], retry, tonumber(r[2])
    local p, p_seq = oldest_parked()
    if p and (not pick or p_seq < pick_seq) then pick, from, pick_seq = p, parked, p_seq end
    local c, c_seq, c_user = nil, nil, nil
    if half_life == 0 then c, c_seq, c_user = oldest_released() end  -- (fair share: its own turn)
    if c and (not pick or c_seq < pick_seq) then pick, from, pick_seq = c, nil, c_seq end
    if not pick then break end
    if #ids >= slots then return stop('blocked', newest()) end  -- the front is never claimed ahead
    local jobkey = job_key(prefix, pick)
    local f = job_fields(jobkey)
    local gpus = need_of(f)
    if from and not under_cap(f[5], gpus) then
      if moved >= 100 then return stop('claimed', '0-0') end  -- enough moved for one call: cut short
      redis.call('ZREM', from, pick)  -- its user is at a cap: held aside (its entry stays pending)
      hold(prefix, f[5], pick, f[6])
      -- In a fair-share queue the user's line holds it: it keeps its place at the front there.
      if half_life > 0 then redis.call('HSET', jobkey, 'front', '1') end
      moved = moved + 1
    else
      if not may_start(gpus, f) then return blocked(pick, gpus) end
      if from then redis.call('ZREM', from, pick) else unhold(prefix, c_user, pick) end
      redis.call('XCLAIM', stream, group, consumer, 0, f[8], 'JUSTID')
      start(pick, jobkey, gpus, f)
    end
  end
end
if #ids == wanted then return stop('claimed', '0-0') end

-- Then the jobs with a priority, the highest first.
-- In a fair-share queue a job whose user is at a cap keeps its place here (passed over, a
-- bounded look): held in its user's line it would lose its priority to the user's later ones.
local prio = prefix .. 'prio'
local passed = 0
while waiting and #ids < wanted do
  local top = redis.call('ZRANGE', prio, passed, passed)[1]
  if not top then break end
  local jobkey = job_key(prefix, top)
  local f = job_fields(jobkey)
  local gpus = need_of(f)
  local queued = f[1] == 'queued'
  local at_cap = queued and gpus <= gpus_total and not under_cap(f[5], gpus)
  if queued and not at_cap and gpus <= gpus_total and not may_start(gpus, f) then return blocked(top, gpus) end
  if at_cap and half_life > 0 then
    passed = passed + 1
    if passed >= 100 then break end
  elseif queued and (gpus > gpus_total or at_cap) then
    if moved >= 100 then return stop('claimed', '0-0') end  -- enough moved for one call: cut short
    moved = moved + 1
  end
  if not (at_cap and half_life > 0) then
    redis.call('ZREM', prio, top)
    if queued then  -- (cancel and take remove a job from `prio` as it leaves 'queued')
      redis.call('XDEL', stream, f[8])
      if gpus > gpus_total then park(top, gpus)
      elseif at_cap then hold(prefix, f[5], top, f[6])
      else start(top, jobkey, gpus, f) end
    end
  end
end
if #ids == wanted then return stop('claimed', '0-0') end

if redis.call('EXISTS', stream) == 0 then return stop('empty', '0-0') end


-- Fair share: the stream's new entries join their users' lines (pending under 'reclaimed', as a
-- parked job's, so never trimmed), and each start goes to the user ranked first (see the top).
if half_life > 0 then
  local fs = prefix .. 'fairshare'
  if tonumber(redis.call('HGET', fs, 'half_life')) ~= half_life then
    redis.call('HSET', fs, 'half_life', half_life)  -- what attempts ending here charge by (_lib.lua)
  end
  local read = redis.call('XREADGROUP', 'GROUP', group, 'reclaimed', 'COUNT', 100 + wanted, 'STREAMS', stream, '>')
  local entries = read and read[1][2] or {}
  local listed = {}  -- the users whose line this call added to: listed in `capped_users` already
  for _, e in ipairs(entries) do
    local id = e[2][1] == 'job' and e[2][2] or nil
    local f = id and job_fields(job_key(prefix, id))
    if not f or f[1] ~= 'queued' then
      drop_entry(stream, group, e[1])
    elseif (tonumber(f[7]) or 0) > 0 and redis.call('ZSCORE', prefix .. 'prio', id) then
      redis.call('XACK', stream, group, e[1])  -- `prio` holds it, and deletes the entry as it starts
    elseif need_of(f) > gpus_total then
      park(id, need_of(f))
    else
      hold(prefix, f[5] or '', id, f[6], listed[f[5] or ''])
      listed[f[5] or ''] = true
    end
  end
  -- A user's rank: {use per weight, jobs running, the seq of their next job}, the least first. The
  -- queue's use and weights are read once per call, in one look.
  local stored = {}
  local all = redis.call('HGETALL', fs)
  for i = 1, #all, 2 do stored[all[i]] = tonumber(all[i + 1]) end
  local function rank(user, seq, front)
    if front then return {0, seq, 0, 0} end  -- from the front (held at a cap): before any line
    local use = 0
    if stored['u:' .. user] then  -- as _lib.lua's decayed, in whole GPU-ms: decayed away is 0
      use = math.floor(stored['u:' .. user] * 2 ^ (-(now - stored['t:' .. user]) / half_life))
    end
    local u = use_of(user)
    return {1, (use + u[3]) / (stored['w:' .. user] or 1), u[1], seq}
  end
  local function before(a, b)
    for i = 1, 4 do
      if a[i] ~= b[i] then return a[i] < b[i] end
    end
    return false
  end
  -- Each user's next job, {id, seq, place in their line}: one look per user per call, another for
  -- the user whose job just started or could not start here (too big, or at a cap: the next of
  -- theirs, up to HELD_LOOK deep).
  local next_of = {}
  local function look(user, place)
    next_of[user] = false
    if place >= HELD_LOOK then return end
    local held = redis.call('ZRANGE', prefix .. 'capped:' .. user, place, place, 'WITHSCORES')
    if held[1] then
      next_of[user] = {held[1], tonumber(held[2]), place, redis.call('HGET', job_key(prefix, held[1]), 'front')}
    end
  end
  local users = redis.call('ZRANGE', capped_users, 0, -1)
  for _, user in ipairs(users) do look(user, 0) end
  while #ids < wanted do
    local best, best_rank, best_user = nil, nil, nil
    for _, user in ipairs(users) do
      local job = next_of[user]
      if job then
        local r = rank(user, job[2], job[4])
        if not best or before(r, best_rank) then best, best_rank, best_user = job, r, user end
      end
    end
    if not best then break end
    local id = best[1]
    local jobkey = job_key(prefix, id)
    local f = job_fields(jobkey)
    local gpus = need_of(f)
    if gpus > gpus_total or not under_cap(best_user, gpus) then
      look(best_user, best[3] + 1)  -- passed over here: the next of theirs
    else
      if not may_start(gpus, f) then return blocked(id, gpus) end
      local top = unhold(prefix, best_user, id)
      redis.call('XCLAIM', stream, group, consumer, 0, f[8], 'JUSTID')
      start(id, jobkey, gpus, f)
      next_of[best_user] = false
      if top[1] then look(best_user, 0) end
    end
  end
  if #ids == wanted or #entries == 100 + wanted then return stop('claimed', '0-0') end
  return stop('empty', delivered())
end

-- Take a stream entry (delivered to this claimer): drop it, pass it over, or start its job.
local function take(entry, fields, f, gpus)
  local id = fields[1] == 'job' and fields[2] or nil
  if not f or f[1] ~= 'queued' then
    drop_entry(stream, group, entry)
  elseif gpus > gpus_total then
    redis.call('XCLAIM', stream, group, 'reclaimed', 0, entry, 'JUSTID')  -- pending, never trimmed
    park(id, gpus)
  elseif not under_cap(f[5], gpus) then
    redis.call('XCLAIM', stream, group, 'reclaimed', 0, entry, 'JUSTID')  -- as a parked one
    hold(prefix, f[5], id, f[6])
  else
    if (tonumber(f[7]) or 0) > 0 then  -- (only a job with a priority is in `prio`: _lib.lua add_job)
      redis.call('ZREM', prefix .. 'prio', id)  -- a no-op: `prio` is served first (see the order)
    end
    start(id, job_key(prefix, id), gpus, f)
  end
end

local function read_of(fields)
  local id = fields[1] == 'job' and fields[2] or nil
  local f = id and job_fields(job_key(prefix, id))
  return f, (f and f[1] == 'queued') and need_of(f) or 0
end

-- Bounded: a long run of dropped or passed-over entries ends this call; the caller claims again.
local last = nil  -- the group's last delivered entry, once looked up
for _ = 1, 100 + wanted do
  if #ids == wanted then return stop('claimed', '0-0') end
  if gpus_free >= gpus_total and not head_need and #rooms == 0 and lifetime <= 0 and serves == '' then
    -- Every GPU this claimer has is free, so no job can make it wait (one asking for more than
    -- it has is passed over): the next entry is taken as it is delivered, without a look first.
    local got = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1, 'STREAMS', stream, '>')
    local nxt = got and got[1][2][1]
    -- The group's last delivered entry is the one this call took last, if it took one.
    if not nxt then return stop('empty', last or delivered()) end
    local f, gpus = read_of(nxt[2])
    take(nxt[1], nxt[2], f, gpus)
    last = nxt[1]
  else
    -- A job may need more GPUs than are free: look at the next entry before it is delivered.
    last = last or delivered()
    local nxt = redis.call('XRANGE', stream, '(' .. last, '+', 'COUNT', 1)[1]
    if not nxt then return stop('empty', last) end
    local f, gpus = read_of(nxt[2])
    if f and f[1] == 'queued' and gpus <= gpus_total and under_cap(f[5], gpus) and not may_start(gpus, f) then
      return blocked(nxt[2][2], gpus)
    end
    redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1, 'STREAMS', stream, '>')
    take(nxt[1], nxt[2], f, gpus)
    last = nxt[1]
  end
end
return stop('claimed', '0-0')  -- cut short, not empty: the caller asks again at once
