-- Extends a held lock by its TTL; never creates a key. The owner id is random per
-- acquisition, so it and the token identify the lease.
-- KEYS[1] = lock key
-- ARGV[1] = '<owner id>:<token>', ARGV[2] = ttl in milliseconds
-- Returns 1 when renewed, 0 when the lease is no longer held.
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] or held == ARGV[1] .. ':w' then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
