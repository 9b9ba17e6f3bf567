-- claim: hand up to N next jobs of one queue to a worker, as leases. A short driver over the
-- scheduler's parts in claim/, each of which says what it decides.
-- Guarantees (atomic, so under any number of concurrent claimers):
--  * one holder: a job is popped from a place or delivered by the consumer group, each of which
--    happens once, and it becomes running with attempt+1 under this worker, with a lease deadline
--    and a lease id that no other claim ever gets (claim/ledger.lua);
--  * order: the places in one fixed order (claim/places.lua): the front, then priorities, then
--    (fair share) the users' lines, then the stream in enqueue order; head of line: the first job
--    that must wait here (for GPUs, CPUs or memory) stops the claim (claim/backfill.lua), and only
--    jobs that cannot delay it start behind it; a job that needs more than this worker has at all
--    never blocks it (parked); one not for this worker (a pilot's end, another user's on a
--    one-user worker) is never waited for (claim/fit.lua);
--  * every job met gets one verdict with a reason code (claim/fit.lua `fit.verdict`), which each place
--    applies with its own moves; `poolctl show` says the same verdict in words (explain.lua);
--  * caps per user (claim/caps.lua), fair share (claim/fairshare.lua), backfill with a
--    reservation (claim/backfill.lua), preemption (claim/preempt.lua), GPU-memory packing
--    (claim/packing.lua), a worker's CPUs and memory fitted with its GPUs (claim/host.lua), as
--    those files say;
--  * once per request: a request sent again (its reply was lost) answers the same leases, still
--    unexpired and renewed from now, without claiming more; an older request arriving late claims
--    nothing (claim/ledger.lua);
--  * at maxmemory the claim is refused whole: its first write is the memo (see _lib.lua);
--  * bounded: every loop stops at a named bound (claim/request.lua) and answers 'claimed', so the
--    caller asks again; cancelled jobs met on the way are acknowledged and deleted, never run.
-- KEYS: 1 stream, 2 the front (keys.py `key.front`), 3 leases, 4 the worker's claim memo, 5 parked
-- ARGV: 1 the request, one msgpack map (daemon/queue/claims.py `ClaimRequest`)
-- Returns {status, stream cursor, wake cursor, what is kept for a head ({GPUs, CPUs, bytes}; {}:
-- none), GPUs free whole left, the shared GPUs' table left, CPUs and memory free left, then id,
-- attempt, lease, spec, shared GPU's place (-1: whole GPUs) of each job claimed}
-- (claim/ledger.lua `ledger.reply`). Status: 'claimed' (N jobs, a request answered again, or cut
-- short at a bound), 'empty' (nothing more), 'blocked' (the next job must wait here for GPUs, CPUs
-- or memory) or 'preempting' (blocked, and jobs here were asked to make room for it). The cursors
-- are the stream ids to wait after (XREAD BLOCK on the stream and the `wake` stream).
--! include lib/record.lua
--! include lib/caps.lua
--! include claim/request.lua
--! include claim/job.lua
--! include claim/packing.lua
--! include claim/host.lua
--! include claim/ledger.lua
--! include claim/caps.lua
--! include claim/fit.lua
--! include claim/places.lua
--! include claim/preempt.lua
--! include claim/backfill.lua
--! include claim/front.lua
--! include claim/priorities.lua
--! include claim/fairshare.lua
--! include claim/stream.lua

if ledger.answered_before() then return ledger.reply('claimed', '0-0') end
front.take_preempting_head()
if req.count == 0 then return preempt.check() end

-- One look for all the places before the stream (most claims find none of them).
if redis.call('EXISTS', key.front, key.parked, key.capped_users, key.prio) > 0 then
  local ended, moved = front.take()
  if ended then return ended end
  if #ledger.ids == req.count then return ledger.stop('claimed', '0-0') end
  ended = priorities.take(moved)
  if ended then return ended end
end
if #ledger.ids == req.count then return ledger.stop('claimed', '0-0') end
if redis.call('EXISTS', key.stream) == 0 then return ledger.stop('empty', '0-0') end
if req.half_life_ms > 0 then return fairshare.take() end
return stream.take()
