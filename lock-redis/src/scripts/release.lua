-- Frees a lock only when this lease (owner and token) still holds it.
-- KEYS[1] = lock key, KEYS[2] = fence key
-- ARGV[1] = owner id, ARGV[2] = the lease's token
-- Returns 1 when released, 0 when the lease was no longer held.
if redis.call('GET', KEYS[1]) == ARGV[1] and redis.call('GET', KEYS[2]) == ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
