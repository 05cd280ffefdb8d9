-- Takes many locks of one hash slot and issues their fencing tokens, in one atomic step:
-- for each lock, what acquire.lua does for one. The clock is read once per call: the
-- locks are different keys, and each is granted only once its earlier holder is gone.
-- KEYS[i] = <prefix>:{<name i>}  (holds '<owner id>:<token>', expires after its ttl)
-- ARGV[2i-1] = owner id i (hex), ARGV[2i] = ttl i in milliseconds; ARGV[2n+1], when
-- present, one byte per lock: '1' to grant lock i marked waited for (as acquire.lua's
-- ARGV[3])
-- Returns one entry per lock: its new token (the current one when it already holds this
-- owner id), or nil when it is held by someone else.
local now = redis.call('TIME')
local token = now[1] .. string.sub('00000' .. now[2], -6)
local marks = ARGV[2 * #KEYS + 1]
local out = {}
for i = 1, #KEYS do
  local owner = ARGV[2 * i - 1]
  local mark = marks and string.byte(marks, i) == 49 and ':w' or ''
  if redis.call('SET', KEYS[i], owner .. ':' .. token .. mark, 'NX', 'PX', ARGV[2 * i]) then
    out[i] = token
  else
    -- Sent again by a client retry: already ours; held by another: marked waited for;
    -- as in acquire.lua.
    local held = redis.call('GET', KEYS[i])
    out[i] = false
    if held then
      local holder, held_token, waited = string.match(held, '^(%x+):(%d+)(:?w?)$')
      if holder == owner then
        out[i] = held_token
      elseif waited == '' then
        redis.call('APPEND', KEYS[i], ':w')
      end
    end
  end
end
return out
