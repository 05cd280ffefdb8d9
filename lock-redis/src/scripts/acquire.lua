-- Takes a lock and issues its fencing token, in one atomic step.
-- KEYS[1] = <prefix>:{<name>}  (holds '<owner id>:<token>', expires after ARGV[2] ms;
--                               ':w' appended once an acquire found it held)
-- ARGV[1] = owner id (hex), ARGV[2] = ttl in milliseconds, ARGV[3] = '1' to grant the
-- lock already marked waited for (other waiters of the client's process watch it, which
-- the release that freed it did not wake: each would otherwise mark it only when it next
-- tries, after its backoff), absent otherwise
-- Returns the new token (the current one when the lock already holds this owner id), or
-- nil when the lock is held by someone else.
--
-- The token is the server's clock in microseconds, read once the key is free: every
-- earlier token of this key was read while an earlier holder's key existed, and that key
-- went by expiry (a TTL of at least a millisecond later) or by a release, which returns
-- only once the clock is past its token. So, as long as the clock of the server that
-- grants does not read earlier than a token it or its predecessor granted, tokens only
-- increase, whatever the server's data came back with (restart, snapshot, FLUSHALL,
-- failover). The clock is built as decimal text: Lua would print a number this large
-- in exponent form.
local now = redis.call('TIME')
local token = now[1] .. string.sub('00000' .. now[2], -6)
local mark = ARGV[3] == '1' and ':w' or ''
if redis.call('SET', KEYS[1], ARGV[1] .. ':' .. token .. mark, 'NX', 'PX', ARGV[2]) then
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
if waited == '' then
  redis.call('APPEND', KEYS[1], ':w')
end
return false
