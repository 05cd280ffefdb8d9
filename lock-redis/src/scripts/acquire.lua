-- Takes a lock and issues its fencing token, in one atomic step.
-- KEYS[1] = <prefix>:{<name>}  (holds '<owner id>:<token>', expires after ARGV[2] ms;
--                               ':w' appended once an acquire found it held)
-- KEYS[2] = the high-water key the lock shares (see below)
-- ARGV[1] = owner id (hex), ARGV[2] = ttl in milliseconds, ARGV[3] = '1' to grant the
-- lock already marked waited for (other waiters of the client's process watch it, which
-- the release that freed it did not wake: each would otherwise mark it only when it next
-- tries, after its backoff), absent otherwise
-- Returns the new token (the current one when the lock already holds this owner id), or
-- nil when the lock is held by someone else.
--
-- The token is one more than the high-water key's, or the server's clock in microseconds
-- when that is higher, and becomes the high-water key's: state first, the clock only as a
-- floor. The high-water key (one per server, or per hash slot on a Cluster) holds the
-- highest token granted to any lock that shares it and never expires, so tokens rise
-- whatever the clock does while it is there; when it is gone (a restart without
-- persistence, FLUSHALL) or behind (a snapshot or a replica that missed the last grants),
-- the clock, which has moved on since, is above what was lost. The clock is built as
-- decimal text, and compared with the high-water token as text (length, then
-- characters), so the common path converts no number; only when the high-water token is
-- not below the clock is it read as a number, one added: Lua numbers are doubles, exact
-- for integers up to 2^53 (a clock in µs reaches that in the year 2255), and '%.0f'
-- prints them without an exponent.
local now = redis.call('TIME')
local token = now[2]
if #token < 6 then
  token = string.sub('00000' .. token, -6)
end
token = now[1] .. token
local high = redis.call('GET', KEYS[2])
if high and (#high > #token or (#high == #token and high >= token)) and tonumber(high) then
  token = string.format('%.0f', tonumber(high) + 1)
end
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
if waited == '' then
  redis.call('APPEND', KEYS[1], ':w')
end
return false
