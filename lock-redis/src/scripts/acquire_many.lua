-- Takes many locks of one hash slot and issues their fencing tokens, in one atomic step:
-- for each lock, what acquire.lua does for one.
-- KEYS[2i-1] = <prefix>:{<name i>}        (owner id, expires after its ttl)
-- KEYS[2i]   = <prefix>:{<name i>}:fence  (newest token, expires after the retention)
-- ARGV[2i-1] = owner id i (hex), ARGV[2i] = ttl i in milliseconds,
-- ARGV[#ARGV - 1] = '1' when the counters are expected to be new (see below), else '0',
-- ARGV[#ARGV] = fence retention in milliseconds
-- Returns one entry per lock: its new token (the current one when it already holds this
-- owner id), nil when it is held by someone else, or an error (that lock not taken) when
-- its counter cannot count on, as in acquire.lua.
--
-- The tokens are acquire.lua's: a kept counter is counted up (`INCR`); one that does not
-- exist (new, expired, flushed, lost) is made at the server's clock. Which is tried first
-- is a matter of cost only: a batch that claims keys never locked before (a lock per job
-- id) makes each counter with one `SET NX` rather than an `INCR` that finds nothing and a
-- `SET`; calls for keys locked again and again count first. The clock is read once per
-- call, as decimal text, so no token is formatted from a Lua number.
local retention = ARGV[#ARGV]
local new_first = ARGV[#ARGV - 1] == '1'
local clock_text, clock
local function read_clock()
  if not clock then
    local now = redis.call('TIME')
    clock_text = now[1] .. string.sub('00000' .. now[2], -6)
    clock = tonumber(clock_text)
  end
end
local out = {}
for i = 1, #KEYS / 2 do
  local lock, fence, owner = KEYS[2 * i - 1], KEYS[2 * i], ARGV[2 * i - 1]
  if redis.call('SET', lock, owner, 'NX', 'PX', ARGV[2 * i]) then
    if new_first then read_clock() end
    if new_first and redis.call('SET', fence, clock_text, 'NX', 'PX', retention) then
      out[i] = clock
    else
      local token = redis.pcall('INCR', fence)
      if type(token) ~= 'number' or token >= 9007199254740992 then
        -- Not a counter, or past what a Lua number (a double) holds exactly: take nothing.
        if type(token) == 'number' then redis.call('DECR', fence) end
        redis.call('DEL', lock)
        out[i] = redis.error_reply('FENCEOVERFLOW the token counter ' .. fence .. ' is not below 2^53')
      else
        if token == 1 then
          read_clock()
          token = clock
          redis.call('SET', fence, clock_text, 'PX', retention)
        end
        out[i] = token
      end
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
