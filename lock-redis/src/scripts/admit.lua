-- Gate for a fenced resource: remembers the highest token admitted for it.
-- KEYS[1] = <prefix>:fenced:{<resource>}
-- ARGV[1] = the writer's token (decimal, no leading zeros)
-- Returns the highest token seen before this call ('' when none); stores the new highest.
-- Tokens are compared as decimal strings (length, then text) so 64-bit values keep
-- their precision, which Lua numbers would lose.
local latest = redis.call('GET', KEYS[1])
local token = ARGV[1]
if not latest or #token > #latest or (#token == #latest and token > latest) then
  redis.call('SET', KEYS[1], token)
end
return latest or ''
