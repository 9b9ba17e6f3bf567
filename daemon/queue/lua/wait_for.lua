-- wait_for: record on a job held out of its queue what it waits for (daemon/after.py), where the
-- server's judge reads it: its own --after, or its place in an array's window of running jobs.
-- Guarantees: the record's 'after' holds the dependencies given (space-separated "JOB:how"); a
-- job not queued any more is left as it is. Safe to run twice.
-- KEYS: 1 the job's record
-- ARGV: 1 the dependencies
-- Returns 1 when written, 0 when the job is not queued.
if redis.call('HGET', KEYS[1], 'state') ~= 'queued' then return 0 end
redis.call('HSET', KEYS[1], 'after', ARGV[1])
return 1
