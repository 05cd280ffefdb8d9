-- Extends many held locks of one hash slot: for each, exactly what renew.lua does for one.
-- KEYS[i] = lock key i, ARGV[2i-1] = '<owner id>:<token>' i, ARGV[2i] = ttl i in ms
-- Returns one entry per lease: 1 when renewed, 0 when no longer held.
local out = {}
for i = 1, #KEYS do
  local held, lease = redis.call('GET', KEYS[i]), ARGV[2 * i - 1]
  if held == lease or held == lease .. ':w' then
    out[i] = redis.call('PEXPIRE', KEYS[i], ARGV[2 * i])
  else
    out[i] = 0
  end
end
return out
