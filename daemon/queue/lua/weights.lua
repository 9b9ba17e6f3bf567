-- weights: set the fair-share weights of a queue's users (the server's, from the tokens file).
-- Guarantees: afterwards the queue's `fairshare` hash holds exactly the weights given ('w:USER');
-- a user left out counts 1 again. Their use and the half-life are left as they are. Safe to run
-- twice. At maxmemory refused whole when it has a weight to add (its first write allocates).
-- KEYS: 1 the queue's fairshare hash
-- ARGV: user, weight, user, weight, ...
-- Returns how many weights it set.
local fs = KEYS[1]
local set = {}
for i = 1, #ARGV, 2 do
  set[#set + 1] = 'w:' .. ARGV[i]
  set[#set + 1] = ARGV[i + 1]
end
if #set > 0 then redis.call('HSET', fs, unpack(set)) end
local given = {}
for i = 1, #set, 2 do given[set[i]] = true end
local all = redis.call('HKEYS', fs)
for _, field in ipairs(all) do
  if string.sub(field, 1, 2) == 'w:' and not given[field] then redis.call('HDEL', fs, field) end
end
return #set / 2
