-- Frees a lock only when this lease still holds it, and announces the release to waiters
-- on the lock key's own name as a pub/sub channel. The owner id is random per acquisition,
-- so it alone identifies the lease.
-- KEYS[1] = lock key
-- ARGV[1] = owner id
-- Returns 1 when released, 0 when the lease was no longer held.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', KEYS[1], '')
  return 1
end
return 0
