-- Takes a lock and issues its fencing token, in one atomic step.
-- KEYS[1] = <prefix>:{<name>}  (holds '<owner id>:<token>', expires after ARGV[2] ms;
--                               ':w' appended once an acquire found it held)
-- KEYS[2] = the high-water key the lock shares (see below)
-- ARGV[1] = owner id (hex), ARGV[2] = ttl in milliseconds, ARGV[3] = '1' to grant the
-- lock already marked waited for (other waiters of the client's process watch it, which
-- the release that freed it did not wake: each would otherwise mark it only when it next
-- tries, after its backoff), '-' to mark nothing (nothing of the client's process hears
-- releases: an announcement would be a PUBLISH for nobody, which the server may refuse),
-- absent or '0' otherwise
-- Returns the new token (the current one when the lock already holds this owner id), or
-- nil when the lock is held by someone else.
--
-- The token is issued as token.lua says.
local token = next_token(KEYS[2])
local mark = ARGV[3] == '1' and ':w' or ''
if redis.call('SET', KEYS[1], ARGV[1] .. ':' .. token .. mark, 'NX', 'PX', ARGV[2]) then
  redis.call('SET', KEYS[2], token)
  return token
end
-- This very attempt sent again (a client retry after a lost reply): the lock is already
-- ours, with the token it was granted.
local held = redis.call('GET', KEYS[1])
if not held then
  return false
end
local owner, held_token, waited = string.match(held, '^(%x+):(%d+)(:?w?)$')
if owner == ARGV[1] then
  return held_token
end
-- Held by another: mark the key waited for, so its release is announced (see
-- release.lua). `APPEND` keeps the key's TTL.
if waited == '' and ARGV[3] ~= '-' then
  redis.call('APPEND', KEYS[1], ':w')
end
return false
