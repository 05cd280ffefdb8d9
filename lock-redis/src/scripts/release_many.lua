-- Frees many locks of one hash slot: for each, exactly what release.lua does for one,
-- the announcement to waiters included.
-- KEYS[i] = lock key i, ARGV[i] = owner id i
-- Returns one entry per lease: 1 when released, 0 when no longer held.
local out = {}
for i = 1, #KEYS do
  local lock = KEYS[i]
  if redis.call('GET', lock) == ARGV[i] then
    redis.call('DEL', lock)
    redis.call('PUBLISH', lock, '')
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
