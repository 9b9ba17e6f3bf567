-- lib/arrays.lua: a job joining its queue, and arrays with a window.
--! include lib/record.lua

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
