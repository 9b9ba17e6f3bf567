-- log: append output chunks of an attempt to its job's log stream, keeping its head and its tail.
-- Guarantees: written only while ARGV's lease is the job's current one, running under this worker
-- (the fencing token), so a zombie attempt cannot interleave its output with the current one;
-- otherwise nothing is written and the answer is 'stale'. Each chunk carries its attempt number
-- (`a`); which execution that was, the job's history says (claim.lua records each attempt's lease
-- id in the script that grants it): chunks are written only under the current lease, so in one
-- Redis's data no two executions' chunks share a number. Each call carries the attempt's call
-- number: a call that arrives again (its reply was lost) writes nothing twice. The log is bounded
-- in bytes (each entry counted with ENTRY_COST for its own keeping): the first `head` bytes stay
-- for good; past them only the newest `tail` bytes are kept, the oldest entries after the head
-- deleted as new ones come, and the bytes deleted counted in `log_dropped`. Where the head ends,
-- an entry `gap=1` (`log_head`) marks the place: readers show there how much was dropped, if
-- any. At maxmemory refused whole (its first write, the call number, allocates): the worker keeps
-- the output until Redis takes it.
-- KEYS: 1 job hash, 2 log stream
-- ARGV: 1 consumer, 2 attempt, 3 lease id, 4 call number, 5 head bytes, 6 tail bytes, 7.. chunks
--! include lib/record.lua
local ENTRY_COST = 64
local job, stream = KEYS[1], KEYS[2]
local j = redis.call('HMGET', job, 'state', 'attempt', 'worker', 'lease', 'log_n', 'log_head', 'log_hbytes',
  'log_tbytes', 'log_dropped')
if not holds(j, ARGV[2], ARGV[1], ARGV[3]) then return 'stale' end
local n = tonumber(ARGV[4])
if n <= (tonumber(j[5]) or 0) then return 'ok' end
local head_max, tail_max = tonumber(ARGV[5]), tonumber(ARGV[6])
local head, hbytes = j[6] or '', tonumber(j[7]) or 0
local tbytes, dropped = tonumber(j[8]) or 0, tonumber(j[9]) or 0
redis.call('HSET', job, 'log_n', n)
for i = 7, #ARGV do
  local id = redis.call('XADD', stream, '*', 'a', ARGV[2], 'd', ARGV[i])
  local cost = #ARGV[i] + ENTRY_COST
  if head == '' then
    hbytes = hbytes + cost
    if hbytes >= head_max then head = redis.call('XADD', stream, '*', 'gap', '1') end
  else
    tbytes = tbytes + cost
  end
end
local deleted = 0  -- bounded per call: a flood of tiny entries is trimmed over several calls
while head ~= '' and tbytes > tail_max and deleted < 1000 do
  deleted = deleted + 1
  local oldest = redis.call('XRANGE', stream, '(' .. head, '+', 'COUNT', 1)[1]
  if not oldest then break end
  local size = 0
  for k = 1, #oldest[2], 2 do
    if oldest[2][k] == 'd' then size = #oldest[2][k + 1] end
  end
  redis.call('XDEL', stream, oldest[1])
  tbytes, dropped = tbytes - size - ENTRY_COST, dropped + size
end
redis.call('HSET', job, 'log_head', head, 'log_hbytes', hbytes, 'log_tbytes', tbytes, 'log_dropped', dropped)
return 'ok'
