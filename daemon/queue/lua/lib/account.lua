-- lib/account.lua: accounting (issue 50): what each job used, kept in one compact record per
-- ended job, for longer than the job's own record (daemon/queue/accounting.py reads them).

-- How many days an accounting record is kept when a caller names none (a worker of before
-- `accounting_retention_days`): the option's default.
local ACCOUNT_DAYS = 400
local DAY_MS = 86400000

-- Add what the attempt ending now used to its job's running totals, as its end is written (from
-- close_attempt, lib/use.lua, in the script that ends the attempt, so each attempt is counted
-- once): 'gpu_ms' (GPUs held times ms run; a job on a shared GPU holds the share its claim
-- wrote, 'milli_gpus', where it wrote one: claim/ledger.lua), 'cpu_ms' (the 'cpus' it asked for, or its queue
-- gave it, times ms run; none before CPUs were a resource) and 'first_ran' (when the first
-- attempt that ran started: the end of the job's wait). `util`, the attempt's mean GPU
-- utilisation in percent where its worker
-- measured it (complete.lua, hand_back.lua; nil: not measured), adds its GPU-ms to 'gpu_measured_ms' and,
-- weighted by it, to 'gpu_used_ms'. An attempt claimed ahead of a free slot that never started
-- used nothing.
local function tally(jobkey, now, util)
  local j = redis.call('HMGET', jobkey, 'held_gpus', 'ran_from', 'started_at', 'ahead', 'cpus', 'milli_gpus')
  if not j[3] or j[4] == '1' then return end
  local from = tonumber(j[2]) or tonumber(j[3])
  local ran = math.max(0, now - from)
  local milli = tonumber(j[6])
  local gpu_ms = milli and math.floor(milli * ran / 1000) or (tonumber(j[1]) or 0) * ran
  redis.call('HINCRBY', jobkey, 'gpu_ms', gpu_ms)
  if util and gpu_ms > 0 then
    redis.call('HINCRBY', jobkey, 'gpu_measured_ms', gpu_ms)
    redis.call('HINCRBYFLOAT', jobkey, 'gpu_used_ms', gpu_ms * util / 100)
  end
  local cpus = tonumber(j[5]) or 0
  if cpus > 0 then redis.call('HINCRBYFLOAT', jobkey, 'cpu_ms', cpus * ran) end
  redis.call('HSETNX', jobkey, 'first_ran', from)
end

-- The state's letter in a record: every terminal state starts with a letter of its own.
local STATE_LETTER = {succeeded = 's', failed = 'f', cancelled = 'c', dead = 'd'}

-- Write the accounting record of job `jobkey`, which ends now as `state` (from `finish`, so once
-- per job, in the script that ends it: exactly once, whatever ends it). The record goes at the
-- end of its queue's list for the day it ended ('acct:DAY', DAY: days since the epoch, Redis
-- time), which expires `days` days after that day ends: no trimming pass, and a year of records
-- is a year of lists. A record is one string of space-separated fields, the user last (read as
-- the rest of the string, so a name may hold spaces):
--   ms into the day it ended, state letter, wait (ms from enqueue to first start; '-': never
--   ran), GPU-ms, CPU-ms, mean GPU utilisation % of its measured attempts (their used over
--   their measured GPU-ms; '-': none measured), user;
-- then, where only some of its GPU-ms were measured, byte 255 and the measured GPU-ms: the
-- efficiency of many jobs weighs each one's utilisation by these. A user name is UTF-8, which
-- never holds byte 255, so the field is told apart from any name; a record without it (all its
-- GPU-ms measured, or none, or written before the field was) reads as all measured.
local function account(prefix, jobkey, state, now, days)
  local j = redis.call('HMGET', jobkey, 'user', 'enqueued_at', 'first_ran', 'gpu_ms', 'cpu_ms', 'gpu_used_ms',
    'gpu_measured_ms')
  local enqueued, ran = tonumber(j[2]), tonumber(j[3])
  local wait = (enqueued and ran) and string.format('%d', math.max(0, ran - enqueued)) or '-'
  local measured = tonumber(j[7]) or 0
  local util = measured > 0 and 100 * (tonumber(j[6]) or 0) / measured or nil
  local day = math.floor(now / DAY_MS)
  local key = prefix .. 'acct:' .. day
  local gpu_ms = tonumber(j[4]) or 0
  local part = (util and measured ~= gpu_ms) and string.format('\255%d', measured) or ''
  redis.call('RPUSH', key, string.format('%d %s %s %d %d %s %s%s', now - day * DAY_MS,
    STATE_LETTER[state] or state, wait, gpu_ms, math.floor(tonumber(j[5]) or 0),
    util and string.format('%d', math.floor(util + 0.5)) or '-', j[1] or '', part))
  redis.call('EXPIREAT', key, math.floor(((day + 1 + (tonumber(days) or ACCOUNT_DAYS)) * DAY_MS) / 1000))
end
