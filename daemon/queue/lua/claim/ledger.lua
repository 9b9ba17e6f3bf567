-- claim/ledger.lua: the call's ledger. The jobs this call starts (each under a lease no other
-- claim ever gets: the worker's id, its request number, an index), what each user runs in the
-- queue, the reply, and the worker's memo that makes a request answered once.
ledger.gpus_free = req.gpus_free  -- GPUs free whole, as this call counts them out
ledger.ids, ledger.claimed = {}, {}  -- the ids started by this call; the reply's rows for them
-- A head job's whole need kept here ({GPUs, CPUs, bytes of memory}: backfill.lua), and when it
-- could start (ms from now); nil: none.
ledger.head_need, ledger.head_at = nil, nil

function ledger.lease_of(i)
  return req.worker .. '/' .. req.request .. '.' .. i
end

-- What each user runs in this queue now, {jobs, GPUs, GPU-ms used so far (each job at least one
-- GPU-ms)}: counted from the leases at the first look a call needs (with caps or fair share), then
-- kept up to date by `ledger.start`. Nothing kept apart can drift.
ledger.usage = nil
function ledger.use_of(user)
  if not ledger.usage then
    ledger.usage = {}
    for _, id in ipairs(redis.call('ZRANGE', key.leases, 0, -1)) do
      local j = redis.call('HMGET', job_key(req.prefix, id), 'user', 'held_gpus', 'started_at')
      if j[1] then
        local u = ledger.usage[j[1]] or {0, 0, 0}
        local g = tonumber(j[2]) or 0
        u[1], u[2] = u[1] + 1, u[2] + g
        u[3] = u[3] + math.max(1, g) * math.max(1, now - (tonumber(j[3]) or now))
        ledger.usage[j[1]] = u
      end
    end
  end
  ledger.usage[user] = ledger.usage[user] or {0, 0, 0}
  return ledger.usage[user]
end

function ledger.reply_row(id, jobkey)
  local j = redis.call('HMGET', jobkey, 'attempt', 'lease', 'spec', 'shared_gpu')
  for _, v in ipairs({id, j[1], j[2], j[3], j[4] or -1}) do ledger.claimed[#ledger.claimed + 1] = v end
end

-- The reply: {status, stream cursor, wake cursor, what is kept for a head job ({GPUs, CPUs, bytes
-- of memory}; {}: none), GPUs free whole left, the shared GPUs' table left, CPUs and bytes of
-- memory free left (host.lua), then id, attempt, lease, spec, shared GPU's place of each job}.
-- The cursors matter only to a claimer that found nothing more to take (it waits after them): a
-- 'claimed' answer carries none.
function ledger.reply(status, cursor)
  local out = {status, cursor, '0-0', ledger.head_need or {}, ledger.gpus_free, packing.left(),
    host.cpus_free, host.mem_free}
  if status ~= 'claimed' then
    local top = redis.call('XREVRANGE', req.prefix .. 'wake', '+', '-', 'COUNT', 1)[1]
    out[3] = top and top[1] or '0-0'
  end
  for _, v in ipairs(ledger.claimed) do out[#out + 1] = v end
  return out
end

-- End the call: the memo records what this request got, for a copy of it to answer the same.
function ledger.stop(status, cursor)
  redis.call('HSET', key.memo, 'jobs', table.concat(ledger.ids, ' '))
  return ledger.reply(status, cursor)
end

-- Start job `j` (job.lua) needing `gpus` here: running, attempt+1, under a new lease. Its GPUs
-- (or its place on a shared GPU, packing.lua) are counted out for the jobs after it; on a shared
-- GPU, its share ('milli_gpus': thousandths of a GPU) is what its accounting charges
-- (lib/account.lua), none said: a whole GPU.
function ledger.start(j, gpus)
  local place = -1
  if j.mem > 0 then
    local milli
    place, milli = packing.pack(j.mem)
    if milli then redis.call('HSET', j.key, 'milli_gpus', milli) else redis.call('HDEL', j.key, 'milli_gpus') end
  else
    ledger.gpus_free = ledger.gpus_free - gpus
  end
  host.take(j.cpus, j.mem_bytes)
  ledger.ids[#ledger.ids + 1] = j.id
  local lease = ledger.lease_of(#ledger.ids)
  local attempt = j.attempt + 1
  redis.call('HSET', j.key, 'attempt', attempt, 'state', 'running', 'worker', req.worker, 'started_at', now,
    'ran_from', now, 'lease', lease, 'log_n', 0, 'held_gpus', gpus, 'shared_gpu', place)
  -- Past the slots free now: claimed ahead of a free slot, till its worker says it started.
  if #ledger.ids > req.slots then redis.call('HSET', j.key, 'ahead', '1') end
  if ledger.usage then
    local u = ledger.use_of(j.user)
    u[1], u[2], u[3] = u[1] + 1, u[2] + gpus, u[3] + math.max(1, gpus)
  end
  redis.call('ZADD', key.leases, now + req.lease_ms, j.id)
  redis.call('RPUSH', j.key .. ':attempts',
    cjson.encode({attempt = attempt, worker = req.worker, started_at = now, how = 'running', lease = lease}))
  local n = #ledger.claimed
  ledger.claimed[n + 1], ledger.claimed[n + 2], ledger.claimed[n + 3] = j.id, attempt, lease
  ledger.claimed[n + 4], ledger.claimed[n + 5] = j.spec, place
end

-- A job answered again holds what it took then: the worker, which never heard of it, sent its
-- GPUs (or its shared GPU's room), CPUs and memory as free, and the claims it makes next in other queues must not
-- count them twice.
function ledger.counted_out(jobkey)
  local h = redis.call('HMGET', jobkey, 'held_gpus', 'shared_gpu', 'gpu_mem_bytes', 'gpu_mem', 'cpus', 'mem_bytes')
  local place = tonumber(h[2]) or -1
  host.take(tonumber(h[5]) or 0, tonumber(h[6]) or 0)
  if place < 0 then
    ledger.gpus_free = ledger.gpus_free - (tonumber(h[1]) or 0)
    return
  end
  for _, g in ipairs(packing.gpus) do
    if g.place == place then
      if not g.shared then ledger.gpus_free, g.shared = ledger.gpus_free - 1, true end
      g.left = g.left - (tonumber(h[3]) or (tonumber(h[4]) or 0) * 1048576)
      g.jobs = g.jobs - 1
    end
  end
end

-- The same request again (its reply was lost): the leases it got that are still this worker's
-- and unexpired, each renewed from now (the worker counts its deadline from this call), and
-- counted out of what the worker has free. An older request arriving late claims nothing. Else the memo is written: the call's first write, which
-- at maxmemory refuses the claim whole (_lib.lua).
function ledger.answered_before()
  local seen = redis.call('HMGET', key.memo, 'request', 'jobs')
  if not (seen[1] and tonumber(seen[1]) >= req.request) then
    redis.call('HSET', key.memo, 'request', req.request, 'jobs', '')
    redis.call('PEXPIRE', key.memo, req.lease_ms)
    return false
  end
  if tonumber(seen[1]) == req.request then
    local i = 0
    for id in string.gmatch(seen[2], '%S+') do
      i = i + 1
      local jobkey = job_key(req.prefix, id)
      local j = redis.call('HMGET', jobkey, 'state', 'worker', 'lease')
      local until_ms = tonumber(redis.call('ZSCORE', key.leases, id))
      if j[1] == 'running' and j[2] == req.worker and j[3] == ledger.lease_of(i) and until_ms and until_ms > now then
        redis.call('ZADD', key.leases, 'XX', now + req.lease_ms, id)
        ledger.reply_row(id, jobkey)
        ledger.counted_out(jobkey)
      end
    end
  end
  return true
end
