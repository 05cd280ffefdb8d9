-- Frees a lock taken by an acquire whose reply was lost: the token is unknown, and the
-- owner id alone identifies that attempt (it is random per attempt). Waiters are told
-- if any marked the key, as on a release.
-- KEYS[1] = lock key, ARGV[1] = owner id, ARGV[2] = 'S' to announce with SPUBLISH or '-'
-- not to announce, as release.lua's ARGV[2]
-- Returns 1 when the key was deleted, 0 otherwise.
-- A permit slot is freed in its semaphore's index too, as release.lua frees it.
local held = redis.call('GET', KEYS[1])
if not held then
  return 0
end
local owner, waited = string.match(held, '^(%x+):%d+(:?w?)$')
if owner ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
local index, slot = permit_index(KEYS[1])
if index and permit_freed(index, slot) then
  waited = 'w'
end
if waited ~= '' and ARGV[2] ~= '-' then
  redis.pcall(ARGV[2] == 'S' and 'SPUBLISH' or 'PUBLISH', KEYS[1], '')
end
permits_freed()
return 1
