-- Tells whether a lease still holds its lock with its token. The owner id is random per
-- acquisition, so it identifies the lease; the token is compared with the counter too
-- while the counter is kept (it may expire under a lease renewed past the retention).
-- KEYS[1] = lock key, KEYS[2] = fence key
-- ARGV[1] = owner id, ARGV[2] = the lease's token
-- Returns {1, the lease's token} when current, {0, newest token or '0'} when stale.
local newest = redis.call('GET', KEYS[2])
if redis.call('GET', KEYS[1]) == ARGV[1] and (not newest or newest == ARGV[2]) then
  return {1, ARGV[2]}
end
return {0, newest or '0'}
