-- Takes a lock and issues its fencing token, in one atomic step.
-- KEYS[1] = <prefix>:{<name>}        (owner id, expires after ARGV[2] ms)
-- KEYS[2] = <prefix>:{<name>}:fence  (newest token, never expires)
-- ARGV[1] = owner id (hex), ARGV[2] = ttl in milliseconds
-- Returns the new token, or nil when the lock is held by someone else.
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return false
end
-- The token is max(counter + 1, server time in microseconds): even when a restart or
-- failover lost the counter, the clock keeps new tokens above every older one.
local counter = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
local now = redis.call('TIME')
local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
local token = math.max(counter + 1, micros)
local text = string.format('%.0f', token)
redis.call('SET', KEYS[2], text)
return text
