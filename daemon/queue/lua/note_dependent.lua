-- note_dependent: job ARGV[1] waits for the job whose `dependents` set is KEYS[1] (daemon/after.py).
-- Guarantees: the waiting job is in the set, which lives ARGV[2] seconds from now (as long as
-- finished jobs are kept, twice over). Safe to run twice. At maxmemory refused (SADD allocates).
-- KEYS: 1 the dependents set of the job waited for
-- ARGV: 1 the waiting job's id, 2 seconds the set lives
-- Returns 1.
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
