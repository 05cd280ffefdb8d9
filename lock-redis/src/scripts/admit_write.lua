-- Fenced write: the token check and the write of the resource's value in one script, so
-- no newer token can be admitted between them.
-- KEYS[1] = <prefix>:fenced:{<resource>}, KEYS[2] = <prefix>:fenced:{<resource>}:data
-- ARGV[1] = the writer's token (decimal, no leading zeros)
-- ARGV[2] = '1' to write a stale token's value too (shadow mode), else '0'
-- ARGV[3] = the value
-- Returns the highest token seen before this call ('' when none); stores the new highest.
-- Tokens are compared as decimal strings (length, then text), as in admit.lua; an equal
-- token is admitted.
local latest = redis.call('GET', KEYS[1])
local token = ARGV[1]
local current = not latest or #token > #latest or (#token == #latest and token >= latest)
if current and latest ~= token then
  redis.call('SET', KEYS[1], token)
end
if current or ARGV[2] == '1' then
  redis.call('SET', KEYS[2], ARGV[3])
end
return latest or ''
