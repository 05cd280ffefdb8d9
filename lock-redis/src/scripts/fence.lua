-- Tells whether a lease still holds its lock with its token.
-- KEYS[1] = lock key, KEYS[2] = fence key
-- ARGV[1] = owner id, ARGV[2] = the lease's token
-- Returns {1, token} when current, {0, newest token or '0'} when stale.
local current = redis.call('GET', KEYS[2])
if current == ARGV[2] and redis.call('GET', KEYS[1]) == ARGV[1] then
  return {1, current}
end
return {0, current or '0'}
