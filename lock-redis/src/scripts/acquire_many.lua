-- Takes many locks of one hash slot and issues their fencing tokens, in one atomic step:
-- for each lock, exactly what acquire.lua does for one.
-- KEYS[2i-1] = <prefix>:{<name i>}        (owner id, expires after its ttl)
-- KEYS[2i]   = <prefix>:{<name i>}:fence  (newest token, never expires)
-- ARGV[2i-1] = owner id i (hex), ARGV[2i] = ttl i in milliseconds
-- Returns one entry per lock: its new token (the current one when it already holds this
-- owner id), nil when it is held by someone else, or an error (that lock not taken) when
-- its counter is at or above 2^53, as in acquire.lua.
local now = redis.call('TIME')
local micros = tonumber(now[1]) * 1000000 + tonumber(now[2])
local out = {}
for i = 1, #KEYS / 2 do
  local lock, fence = KEYS[2 * i - 1], KEYS[2 * i]
  local counter = tonumber(redis.call('GET', fence) or '0') or 0
  if counter >= 9007199254740992 then
    out[i] = redis.error_reply('FENCEOVERFLOW the token counter ' .. fence .. ' is at or above 2^53')
  elseif redis.call('SET', lock, ARGV[2 * i - 1], 'NX', 'PX', ARGV[2 * i]) then
    -- max(counter + 1, server µs), as in acquire.lua.
    local text = string.format('%.0f', math.max(counter + 1, micros))
    redis.call('SET', fence, text)
    out[i] = text
  elseif redis.call('GET', lock) == ARGV[2 * i - 1] then
    -- Sent again by a client retry: already ours, as in acquire.lua.
    out[i] = redis.call('GET', fence)
  else
    out[i] = false
  end
end
return out
