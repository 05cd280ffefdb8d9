-- Frees many locks of one hash slot: for each, exactly what release.lua does for one,
-- the best-effort announcement to waiters of a key marked waited for included; the clock is then waited for past
-- the highest token released, once.
-- KEYS[i] = lock key i, ARGV[2i-1] = '<owner id>:<token>' i, ARGV[2i] = token i, and
-- after them 'S' to announce with SPUBLISH, as release.lua's ARGV[3]
-- Returns one entry per lease: 1 when released, 0 when no longer held.
local announce = ARGV[2 * #KEYS + 1] == 'S' and 'SPUBLISH' or 'PUBLISH'
local out = {}
local highest = 0
for i = 1, #KEYS do
  local lock = KEYS[i]
  local held, lease = redis.call('GET', lock), ARGV[2 * i - 1]
  if held == lease or held == lease .. ':w' then
    redis.call('DEL', lock)
    if held ~= lease then
      redis.pcall(announce, lock, '')
    end
    highest = math.max(highest, tonumber(ARGV[2 * i]))
    out[i] = 1
  else
    out[i] = 0
  end
end
for _ = 1, 1000 do
  local now = redis.call('TIME')
  if now[1] * 1000000 + now[2] > highest then break end
end
return out
