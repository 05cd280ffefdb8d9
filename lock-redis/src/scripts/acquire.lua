-- Takes a lock and issues its fencing token, in one atomic step.
-- KEYS[1] = <prefix>:{<name>}        (owner id, expires after ARGV[2] ms)
-- KEYS[2] = <prefix>:{<name>}:fence  (newest token, expires ARGV[3] ms after it is made)
-- ARGV[1] = owner id (hex), ARGV[2] = ttl in milliseconds, ARGV[3] = fence retention in ms
-- Returns the new token (the current one when the lock already holds this owner id), nil
-- when the lock is held by someone else, or an error, having taken nothing, when the
-- counter cannot count on.
--
-- The token is INCR of the counter. A counter that is new, expired after its retention,
-- flushed or lost in a restart makes INCR return 1: the token is then the server's clock
-- in microseconds, above every token granted before, since each of those took a grant of
-- its own (at least a microsecond of server time apiece) since the clock value it counted
-- up from.
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local token = redis.pcall('INCR', KEYS[2])
  if type(token) ~= 'number' or token >= 9007199254740992 then
    -- Not a counter, or past what a Lua number (a double) holds exactly: take nothing.
    if type(token) == 'number' then redis.call('DECR', KEYS[2]) end
    redis.call('DEL', KEYS[1])
    return redis.error_reply('FENCEOVERFLOW the token counter ' .. KEYS[2] .. ' is not below 2^53')
  end
  if token == 1 then
    local now = redis.call('TIME')
    token = now[1] * 1000000 + now[2]
    redis.call('SET', KEYS[2], token, 'PX', ARGV[3])
  end
  return token
end
-- This very attempt sent again (a client retry after a lost reply): the lock is already
-- ours, and nobody can have taken a newer token meanwhile.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  local token = redis.call('GET', KEYS[2])
  if token then
    return token
  end
  -- The counter is gone (flushed by hand): give the lock back rather than hold it blind.
  redis.call('DEL', KEYS[1])
end
return false
