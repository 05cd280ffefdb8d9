-- Extends many held locks of one hash slot: for each, exactly what renew.lua does for one.
-- KEYS[2i-1] = lock key i, KEYS[2i] = fence key i
-- ARGV[3i-2] = owner id i, ARGV[3i-1] = lease token i, ARGV[3i] = ttl i in milliseconds
-- Returns one entry per lease: 1 when renewed, 0 when no longer held.
local out = {}
for i = 1, #KEYS / 2 do
  local lock, fence = KEYS[2 * i - 1], KEYS[2 * i]
  if redis.call('GET', lock) == ARGV[3 * i - 2] and redis.call('GET', fence) == ARGV[3 * i - 1] then
    out[i] = redis.call('PEXPIRE', lock, ARGV[3 * i])
  else
    out[i] = 0
  end
end
return out
