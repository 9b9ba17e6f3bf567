-- log: append output chunks of an attempt to its job's log stream.
-- Guarantees: written only while ARGV's attempt is the job's current attempt and running under
-- this worker (the fencing token), so a zombie attempt cannot interleave its output with the
-- current one; otherwise nothing is written and the answer is 'stale'. The stream is capped.
-- KEYS: 1 job hash, 2 log stream
-- ARGV: 1 consumer, 2 attempt, 3 cap (entries), 4.. chunks
local j = redis.call('HMGET', KEYS[1], 'state', 'attempt', 'worker')
if j[1] ~= 'running' or j[2] ~= ARGV[2] or j[3] ~= ARGV[1] then return 'stale' end
for i = 4, #ARGV do
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'a', ARGV[2], 'd', ARGV[i])
end
return 'ok'
