-- Gives back the permit slot an attempt of acquire_permit.lua may have taken, when its
-- reply was lost: the token and the slot are unknown, and the owner id alone identifies
-- the attempt (it is random per attempt). Waiters are told, as on a release.
-- KEYS[1] = the semaphore's index, KEYS[2] = its due set, KEYS[3] = its waiters' flag (as
-- in acquire_permit.lua)
-- ARGV[1] = owner id, ARGV[2] = the slot keys' common part (as acquire_permit.lua's
-- ARGV[4]), ARGV[3] = 'S' to announce with SPUBLISH or '-' not to announce, as
-- release.lua's ARGV[2]
-- Returns 1 when a slot was given back, 0 otherwise.
local found = permits_of(KEYS[1], ARGV[2], {[ARGV[1]] = true})[ARGV[1]]
if not found then
  return 0
end
local slot = found[1]
local lock = ARGV[2] .. slot
redis.call('DEL', lock)
if permit_freed(KEYS[1], slot) and ARGV[3] ~= '-' then
  redis.pcall(ARGV[3] == 'S' and 'SPUBLISH' or 'PUBLISH', lock, '')
end
permits_freed()
return 1
