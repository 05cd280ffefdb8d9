-- Frees a lock only when this lease still holds it, and announces the release to waiters
-- on the lock key's own name as a pub/sub channel when one marked the key waited for
-- (an acquire that found it held appends ':w' to its value): a release nobody waits for
-- costs no PUBLISH.
-- KEYS[1] = lock key
-- ARGV[1] = '<owner id>:<token>', ARGV[2] = 'S' to announce with SPUBLISH (a Redis 7
-- cluster: the message stays on the key's shard), '-' not to announce (the server refuses
-- this user's announcements), absent for PUBLISH
-- Returns 1 when released, 0 when the lease was no longer held.
--
-- A semaphore's permit slot is freed in its index too (see permits.lua), and the release
-- announced when a refused attempt of the semaphore waits.
--
-- The announcement is best effort: a user without rights on the channel gets an error
-- from PUBLISH, which must not undo or fail the release. Nothing waits for the clock: the
-- next token comes from the high-water key the grant raised (see acquire.lua).
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] or held == ARGV[1] .. ':w' then
  redis.call('DEL', KEYS[1])
  local waited = held ~= ARGV[1]
  local index, slot = permit_index(KEYS[1])
  if index and permit_freed(index, slot) then
    waited = true
  end
  if waited and ARGV[2] ~= '-' then
    redis.pcall(ARGV[2] == 'S' and 'SPUBLISH' or 'PUBLISH', KEYS[1], '')
  end
  permits_freed()
  return 1
end
return 0
