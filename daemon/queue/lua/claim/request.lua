-- claim/request.lua: what the claim is asked (ARGV[1], one msgpack map: daemon/queue/claims.py
-- `ClaimRequest.packed`, which names every field), and the bounds every part of a claim keeps.
-- Capacity is in GPUs, bytes and ms; nothing here is parsed from a string.
local req = cmsgpack.unpack(ARGV[1])
local prefix, group, consumer = req.prefix, req.group, req.worker
local request, wanted, slots, lease_ms = req.request, req.count, req.slots, req.lease_ms
local gpus_free, gpus_total, slot_gpus = req.gpus_free, req.gpus_total, req.slot_gpus
local largest_gpu = req.largest_gpu  -- bytes of the worker's largest GPU (0: no shared GPU table)
local grace_ms, lifetime, serves = req.grace_ms, req.lifetime_ms, req.serves
local max_jobs, max_gpus, half_life, preempts = req.max_jobs, req.max_gpus, req.half_life_ms, req.preempt
local stream, front, leases, memo, parked = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local prio, capped_users, reservation = prefix .. 'prio', prefix .. 'capped_users', prefix .. 'reservation'
local now = now_ms()

-- Bounds: each claim call does a bounded amount of work, and says 'claimed' (ask again at once)
-- when it stops at one rather than at the end of the queue.
local MOVES = 100       -- jobs moved aside (parked, held at a cap, passed) in one call
local STREAM_READ = 100  -- stream entries read past what is wanted, in one call
local LOOK = 50         -- jobs of each place a backfill looks at
local HELD_LOOK = 20    -- jobs of one user's line looked at, past those too big or over a cap
local SEQ = 4294967296  -- above any seq a queue reaches: `parked` is scored GPUs * SEQ + seq
