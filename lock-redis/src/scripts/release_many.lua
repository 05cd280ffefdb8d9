-- Frees many locks of one hash slot: for each, exactly what release.lua does for one,
-- the announcement to waiters included.
-- KEYS[2i-1] = lock key i, KEYS[2i] = fence key i
-- ARGV[2i-1] = owner id i, ARGV[2i] = lease token i
-- Returns one entry per lease: 1 when released, 0 when no longer held.
local out = {}
for i = 1, #KEYS / 2 do
  local lock, fence = KEYS[2 * i - 1], KEYS[2 * i]
  if redis.call('GET', lock) == ARGV[2 * i - 1] and redis.call('GET', fence) == ARGV[2 * i] then
    redis.call('DEL', lock)
    redis.call('PUBLISH', lock, '')
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
