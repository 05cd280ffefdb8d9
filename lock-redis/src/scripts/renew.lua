-- Extends a held lock by its TTL; never creates a key. The owner id is random per
-- acquisition, so it alone identifies the lease.
-- KEYS[1] = lock key
-- ARGV[1] = owner id, ARGV[2] = ttl in milliseconds
-- Returns 1 when renewed, 0 when the lease is no longer held.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
