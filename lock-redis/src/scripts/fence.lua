-- Tells whether a lease still holds its lock with its token.
-- KEYS[1] = lock key, KEYS[2] = the high-water key it shares (see token.lua)
-- ARGV[1] = '<owner id>:<token>', ARGV[2] = the lease's token
-- Returns {1, the lease's token} when current, and {0, token} when stale: the holder's
-- token when someone else holds the key; for a free key the high-water key's, which is
-- at least every token granted for the key so far and below every later one, or, when
-- that key is gone, the server's clock in microseconds, the floor of the next token (see
-- token.lua). A free key keeps no token of its own.
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] or held == ARGV[1] .. ':w' then
  return {1, ARGV[2]}
end
local token = held and string.match(held, '^%x+:(%d+)')
if token then
  return {0, token}
end
token = redis.call('GET', KEYS[2])
if token then
  return {0, token}
end
return {0, clock_us()}
