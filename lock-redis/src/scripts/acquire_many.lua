-- Takes many locks of one hash slot and issues their fencing tokens, in one atomic step:
-- for each lock, exactly what acquire.lua does for one.
-- KEYS[2i-1] = <prefix>:{<name i>}        (owner id, expires after its ttl)
-- KEYS[2i]   = <prefix>:{<name i>}:fence  (newest token, expires after the retention)
-- ARGV[2i-1] = owner id i (hex), ARGV[2i] = ttl i in milliseconds,
-- ARGV[#ARGV] = fence retention in milliseconds
-- Returns one entry per lock: its new token (the current one when it already holds this
-- owner id), nil when it is held by someone else, or an error (that lock not taken) when
-- its counter cannot count on, as in acquire.lua.
local retention = ARGV[#ARGV]
local clock
local out = {}
for i = 1, #KEYS / 2 do
  local lock, fence, owner = KEYS[2 * i - 1], KEYS[2 * i], ARGV[2 * i - 1]
  if redis.call('SET', lock, owner, 'NX', 'PX', ARGV[2 * i]) then
    local token = redis.pcall('INCR', fence)
    if type(token) ~= 'number' or token >= 9007199254740992 then
      if type(token) == 'number' then redis.call('DECR', fence) end
      redis.call('DEL', lock)
      out[i] = redis.error_reply('FENCEOVERFLOW the token counter ' .. fence .. ' is not below 2^53')
    else
      if token == 1 then
        if not clock then
          local now = redis.call('TIME')
          clock = now[1] * 1000000 + now[2]
        end
        token = clock
        redis.call('SET', fence, token, 'PX', retention)
      end
      out[i] = token
    end
  elseif redis.call('GET', lock) == owner then
    -- Sent again by a client retry: already ours, as in acquire.lua.
    local token = redis.call('GET', fence)
    if not token then redis.call('DEL', lock) end
    out[i] = token or false
  else
    out[i] = false
  end
end
return out
