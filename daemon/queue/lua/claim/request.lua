-- claim/request.lua: what the claim is asked (ARGV[1], one msgpack map: daemon/queue/claims.py
-- `ClaimRequest.packed`, which names every field: req.count, req.slots, req.gpus_total, ...), the
-- keys it works on, and the bounds every part of a claim keeps. Capacity is in GPUs, bytes and ms;
-- nothing here is parsed from a string.
local req = cmsgpack.unpack(ARGV[1])
local key = {stream = KEYS[1], front = KEYS[2], leases = KEYS[3], memo = KEYS[4], parked = KEYS[5],
  prio = req.prefix .. 'prio', capped_users = req.prefix .. 'capped_users', reservation = req.prefix .. 'reservation'}
local now = now_ms()

-- The parts of a claim, one table of functions per file of claim/ (`fit.verdict` is claim/fit.lua's
-- verdict), declared before any is filled in since they call each other. A call builds every
-- function anew (Redis runs a script's whole body at each call), so each captures a few tables,
-- not one local per name: what a function captures, Lua looks up when it builds it.
local job, packing, host, ledger, caps, fit, places, preempt = {}, {}, {}, {}, {}, {}, {}, {}
local backfill, front, priorities, fairshare, stream = {}, {}, {}, {}, {}

-- Bounds: each claim call does a bounded amount of work, and says 'claimed' (ask again at once)
-- when it stops at one rather than at the end of the queue.
local MOVES = 100       -- jobs moved aside (parked, held at a cap, passed) in one call
local STREAM_READ = 100  -- stream entries read past what is wanted, in one call
local LOOK = 50         -- jobs of each place a backfill looks at
local HELD_LOOK = 20    -- jobs of one user's line looked at, past those too big or over a cap
local SEQ = 4294967296  -- above any seq a queue reaches: `parked` is scored GPUs * SEQ + seq
