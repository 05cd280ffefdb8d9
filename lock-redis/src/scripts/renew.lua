-- Extends a held lock by its TTL; never creates a key.
-- KEYS[1] = lock key, KEYS[2] = fence key
-- ARGV[1] = owner id, ARGV[2] = the lease's token, ARGV[3] = ttl in milliseconds
-- Returns 1 when renewed, 0 when the lease is no longer held.
if redis.call('GET', KEYS[1]) == ARGV[1] and redis.call('GET', KEYS[2]) == ARGV[2] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 0
