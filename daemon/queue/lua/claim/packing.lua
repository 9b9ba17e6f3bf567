-- claim/packing.lua: GPU memory. A job asking for memory on one shared GPU (`mem`, bytes) goes on
-- a GPU of the worker's table with room for it (its memory left, and fewer jobs than the cap): one
-- already shared, the fullest that fits (so shared jobs pack and leave GPUs whole), else a GPU free
-- whole, which is then no longer free for a job of whole GPUs. A GPU held whole is never in the
-- table. Such a job counts as one GPU towards caps and fair share; its accounting charges its
-- share of the GPU (`packing.pack`).

-- The worker's table: {place in its list of GPUs, bytes left, jobs it may take yet, shared
-- already, bytes in all (0 or nil: not said, by a worker of before)}.
packing.gpus = {}
for _, r in ipairs(req.shared) do
  packing.gpus[#packing.gpus + 1] = {place = r[1], left = r[2], jobs = r[3], shared = r[4], memory = r[5] or 0}
end

-- The GPU a job asking for `mem` bytes would go on here now; nil when none has room.
function packing.gpu_for(mem)
  local best = nil
  for _, g in ipairs(packing.gpus) do
    if g.jobs > 0 and g.left >= mem and (g.shared or ledger.gpus_free > 0) then
      if not best or (g.shared and not best.shared) or (g.shared == best.shared and g.left < best.left) then
        best = g
      end
    end
  end
  return best
end

-- Put a job asking for `mem` bytes on its GPU (gpu_for found one): its place in the worker's
-- list, and the thousandths of a GPU it holds (its bytes over the GPU's, at least one; nil where
-- the worker did not say the GPU's bytes: it is charged a whole GPU).
function packing.pack(mem)
  local g = packing.gpu_for(mem)
  if not g.shared then ledger.gpus_free, g.shared = ledger.gpus_free - 1, true end  -- no longer free whole
  g.left, g.jobs = g.left - mem, g.jobs - 1
  local milli = g.memory > 0 and math.max(1, math.min(1000, math.floor(1000 * mem / g.memory + 0.5))) or nil
  return g.place, milli
end

-- The table as this call leaves it, for the reply.
function packing.left()
  local rows = {}
  for _, g in ipairs(packing.gpus) do rows[#rows + 1] = {g.place, g.left, g.jobs, g.shared and 1 or 0, g.memory} end
  return rows
end
