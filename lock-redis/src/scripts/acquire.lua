-- Takes a lock and issues its fencing token, in one atomic step.
-- KEYS[1] = <prefix>:{<name>}        (owner id, expires after ARGV[2] ms)
-- KEYS[2] = <prefix>:{<name>}:fence  (newest token, never expires)
-- ARGV[1] = owner id (hex), ARGV[2] = ttl in milliseconds
-- Returns the new token (the current one when the lock already holds this owner id), nil
-- when the lock is held by someone else, or an error, having taken nothing, when the
-- counter is too large to count on.
local counter = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
-- Lua numbers are doubles: from 2^53 on, counter + 1 rounds back and repeats a token.
if counter >= 9007199254740992 then
  return redis.error_reply('FENCEOVERFLOW the token counter ' .. KEYS[2] .. ' is at or above 2^53')
end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  -- This very attempt sent again (a client retry after a lost reply): the lock is
  -- already ours, and nobody can have taken a newer token meanwhile.
  if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('GET', KEYS[2])
  end
  return false
end
-- The token is max(counter + 1, server time in microseconds): even when a restart or
-- failover lost the counter, the clock keeps new tokens above every older one.
local now = redis.call('TIME')
local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
local token = math.max(counter + 1, micros)
local text = string.format('%.0f', token)
redis.call('SET', KEYS[2], text)
return text
