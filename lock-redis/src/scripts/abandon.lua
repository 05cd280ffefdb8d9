-- Frees a lock taken by an acquire whose reply was lost: the token is unknown, and the
-- owner id alone identifies that attempt (it is random per attempt). Waiters are told,
-- as on a release.
-- KEYS[1] = lock key, ARGV[1] = owner id
-- Returns 1 when the key was deleted, 0 otherwise.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', KEYS[1], '')
  return 1
end
return 0
