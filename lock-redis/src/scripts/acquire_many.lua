-- Takes many locks of one hash slot and issues their fencing tokens, in one atomic step:
-- for each lock, what acquire.lua does for one. One token serves the call: the locks are
-- different keys, and it is above every token the high-water key they share has seen.
-- KEYS[1..n] = <prefix>:{<name i>}  (holds '<owner id>:<token>', expires after its ttl);
-- KEYS[n+1] = the high-water key they share (as in acquire.lua)
-- ARGV[2i-1] = owner id i (hex), ARGV[2i] = ttl i in milliseconds; ARGV[2n+1], when
-- present, one byte per lock: '1' to grant lock i marked waited for, '-' to mark nothing,
-- '0' otherwise (as acquire.lua's ARGV[3])
-- Returns one entry per lock: its new token (the current one when it already holds this
-- owner id), or nil when it is held by someone else.
local n = #KEYS - 1
local token = next_token(KEYS[n + 1])
local marks = ARGV[2 * n + 1]
local granted = false
local out = {}
for i = 1, n do
  local owner = ARGV[2 * i - 1]
  local byte = marks and string.byte(marks, i)
  local mark = byte == 49 and ':w' or ''
  if redis.call('SET', KEYS[i], owner .. ':' .. token .. mark, 'NX', 'PX', ARGV[2 * i]) then
    out[i] = token
    granted = true
  else
    -- Sent again by a client retry: already ours; held by another: marked waited for;
    -- as in acquire.lua.
    local held = redis.call('GET', KEYS[i])
    out[i] = false
    if held then
      local holder, held_token, waited = string.match(held, '^(%x+):(%d+)(:?w?)$')
      if holder == owner then
        out[i] = held_token
      elseif waited == '' and byte ~= 45 then
        redis.call('APPEND', KEYS[i], ':w')
      end
    end
  end
end
if granted then
  redis.call('SET', KEYS[n + 1], token)
end
return out
