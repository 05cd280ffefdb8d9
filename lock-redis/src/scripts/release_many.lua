-- Frees many locks of one hash slot: for each, exactly what release.lua does for one,
-- the best-effort announcement to waiters of a key marked waited for included.
-- KEYS[i] = lock key i, ARGV[i] = '<owner id>:<token>' i, and after them 'S' to announce
-- with SPUBLISH or '-' not to announce, as release.lua's ARGV[2]
-- Returns one entry per lease: 1 when released, 0 when no longer held.
-- A permit slot is freed in its semaphore's index too, as release.lua frees it; an index
-- whose slots the call frees is looked at once for being idle, and its waiters' flag
-- cleared once (the first slot freed is announced).
local how = ARGV[#KEYS + 1]
local announce = how == 'S' and 'SPUBLISH' or 'PUBLISH'
local out = {}
for i = 1, #KEYS do
  local lock = KEYS[i]
  local held, lease = redis.call('GET', lock), ARGV[i]
  if held == lease or held == lease .. ':w' then
    redis.call('DEL', lock)
    local waited = held ~= lease
    local index, slot = permit_index(lock)
    if index and permit_freed(index, slot) then
      waited = true
    end
    if waited and how ~= '-' then
      redis.pcall(announce, lock, '')
    end
    out[i] = 1
  else
    out[i] = 0
  end
end
permits_freed()
return out
