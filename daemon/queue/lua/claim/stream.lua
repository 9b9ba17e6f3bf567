-- claim/stream.lua: the stream's entries, strictly in enqueue order, once the front and the
-- priorities have nothing this worker takes (FIFO queues; fair share reads them into the users'
-- lines instead). Bounded: a long run of dropped or passed-over entries ends the call with
-- 'claimed', and the caller claims again.

-- A delivered entry, judged (`v`, fit.lua's verdict on job `j`): dropped, passed over (pending
-- under 'reclaimed', so never trimmed, as a parked or held job's), or its job started.
local function take_entry(entry, j, v, gpus)
  if v == 'gone' then
    drop_entry(stream, group, entry)
  elseif v == 'park' or v == 'hold' then
    redis.call('XCLAIM', stream, group, 'reclaimed', 0, entry, 'JUSTID')
    if v == 'park' then park(j, gpus) else hold(prefix, j.user, j.id, j.seq) end
  else
    if j.priority > 0 then redis.call('ZREM', prio, j.id) end  -- (served first: a no-op)
    start(j, gpus)
  end
end

local function judged(fields)
  local j = fields[1] == 'job' and job_of(fields[2]) or nil
  if not j then return nil, 'gone', 0 end
  local v, _, gpus = verdict(j)
  return j, v, gpus
end

-- Every GPU this claimer has is free, nothing is kept for a head, no GPU to share (so a --gpu-mem
-- job is too big here), no lifetime, any user's job: no job can make it wait (one asking for more
-- than it has is passed over), so the next entry is taken as it is delivered, without a look first.
local function nothing_can_wait()
  return gpus_free >= gpus_total and not head_need and largest_gpu == 0 and lifetime <= 0 and serves == ''
end

local function take_stream()
  local last = nil  -- the group's last delivered entry, once looked up
  for _ = 1, STREAM_READ + wanted do
    if #ids == wanted then return stop('claimed', '0-0') end
    local nxt
    if nothing_can_wait() then
      local got = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1, 'STREAMS', stream, '>')
      nxt = got and got[1][2][1]
      if not nxt then return stop('empty', last or delivered()) end
      take_entry(nxt[1], judged(nxt[2]))
    else
      last = last or delivered()
      nxt = redis.call('XRANGE', stream, '(' .. last, '+', 'COUNT', 1)[1]
      if not nxt then return stop('empty', last) end
      local j, v, gpus = judged(nxt[2])
      if v == 'wait' then return blocked(j, gpus) end
      redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1, 'STREAMS', stream, '>')
      take_entry(nxt[1], j, v, gpus)
    end
    last = nxt[1]
  end
  return stop('claimed', '0-0')  -- cut short, not empty: the caller asks again at once
end
