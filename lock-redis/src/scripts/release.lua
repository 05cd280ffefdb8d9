-- Frees a lock only when this lease (owner and token) still holds it, and announces the
-- release to waiters on the lock key's own name as a pub/sub channel.
-- KEYS[1] = lock key, KEYS[2] = fence key
-- ARGV[1] = owner id, ARGV[2] = the lease's token
-- Returns 1 when released, 0 when the lease was no longer held.
if redis.call('GET', KEYS[1]) == ARGV[1] and redis.call('GET', KEYS[2]) == ARGV[2] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', KEYS[1], '')
  return 1
end
return 0
