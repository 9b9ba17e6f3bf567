-- claim/stream.lua: the stream's entries, strictly in enqueue order, once the front and the
-- priorities have nothing this worker takes (FIFO queues; fair share reads them into the users'
-- lines instead). Bounded: a long run of dropped or passed-over entries ends the call with
-- 'claimed', and the caller claims again.

-- A delivered entry, judged (`v`, fit.lua's verdict on job `j`): dropped, passed over (pending
-- under 'reclaimed', so never trimmed, as a parked or held job's), or its job started.
function stream.take_entry(entry, j, v, gpus)
  if v == 'gone' then
    drop_entry(key.stream, req.group, entry)
  elseif v == 'park' or v == 'hold' then
    redis.call('XCLAIM', key.stream, req.group, 'reclaimed', 0, entry, 'JUSTID')
    if v == 'park' then places.park(j, gpus) else hold(req.prefix, j.user, j.id, j.seq) end
  else
    if j.priority > 0 then redis.call('ZREM', key.prio, j.id) end  -- (served first: a no-op)
    ledger.start(j, gpus)
  end
end

function stream.judged(fields)
  local j = fields[1] == 'job' and job.of(fields[2]) or nil
  if not j then return nil, 'gone', 0 end
  local v, _, gpus = fit.verdict(j)
  return j, v, gpus
end

-- Every GPU, CPU and byte of memory this claimer has is free, nothing is kept for a head, no GPU to
-- share (so a --gpu-mem job is too big here), no lifetime, any user's job: no job can make it wait
-- (one asking for more than it has is passed over), so the next entry is taken as it is delivered,
-- without a look first.
function stream.nothing_can_wait()
  return ledger.gpus_free >= req.gpus_total and host.cpus_free >= host.cpus_total and host.mem_free >= host.mem_total
    and not ledger.head_need and req.largest_gpu == 0 and req.lifetime_ms <= 0 and req.serves == ''
end

function stream.take()
  local last = nil  -- the group's last delivered entry, once looked up
  for _ = 1, STREAM_READ + req.count do
    if #ledger.ids == req.count then return ledger.stop('claimed', '0-0') end
    local nxt
    if stream.nothing_can_wait() then
      local got = redis.call('XREADGROUP', 'GROUP', req.group, req.worker, 'COUNT', 1, 'STREAMS', key.stream, '>')
      nxt = got and got[1][2][1]
      if not nxt then return ledger.stop('empty', last or places.delivered()) end
      stream.take_entry(nxt[1], stream.judged(nxt[2]))
    else
      last = last or places.delivered()
      nxt = redis.call('XRANGE', key.stream, '(' .. last, '+', 'COUNT', 1)[1]
      if not nxt then return ledger.stop('empty', last) end
      local j, v, gpus = stream.judged(nxt[2])
      if v == 'wait' then return backfill.blocked(j, gpus) end
      redis.call('XREADGROUP', 'GROUP', req.group, req.worker, 'COUNT', 1, 'STREAMS', key.stream, '>')
      stream.take_entry(nxt[1], j, v, gpus)
    end
    last = nxt[1]
  end
  return ledger.stop('claimed', '0-0')  -- cut short, not empty: the caller asks again at once
end
