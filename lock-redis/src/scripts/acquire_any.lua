-- Takes one free lock of several (a semaphore's permit slots) and issues its fencing
-- token, in one atomic step.
-- KEYS[1..n] = <prefix>:{<name i>}  (as in acquire.lua); KEYS[n+1] = the high-water key
-- they share (as in acquire.lua)
-- ARGV[1] = owner id (hex), the same for every key of the attempt; ARGV[2] = ttl in ms;
-- ARGV[3] = '1' to grant the lock marked waited for, '-' to mark nothing, as in
-- acquire.lua ('0' otherwise);
-- ARGV[4] = 'R' when this attempt is sent again (a client retry after a lost reply)
-- Returns {i, token}: the first free lock, taken. Sent again, it first looks for the lock
-- this attempt took the first time and returns that one, with its token, so a resent
-- attempt never takes a second lock (a first send skips that look: it reads only up to
-- the first free lock). Returns nil when another holds every lock, each then marked
-- waited for, as acquire.lua marks one, so its release is announced to the semaphore's
-- waiters.
--
-- The token is issued as in acquire.lua.
local n = #KEYS - 1
if ARGV[4] == 'R' then
  for i = 1, n do
    local held = redis.call('GET', KEYS[i])
    if held then
      local owner, token = string.match(held, '^(%x+):(%d+)')
      if owner == ARGV[1] then
        return {i, token}
      end
    end
  end
end
local token = next_token(KEYS[n + 1])
local mark = ARGV[3] == '1' and ':w' or ''
for i = 1, n do
  if redis.call('SET', KEYS[i], ARGV[1] .. ':' .. token .. mark, 'NX', 'PX', ARGV[2]) then
    redis.call('SET', KEYS[n + 1], token)
    return {i, token}
  end
end
-- Every lock is held: mark each waited for (unless told not to). `APPEND` keeps the key's
-- TTL.
if ARGV[3] ~= '-' then
  for i = 1, n do
    local held = redis.call('GET', KEYS[i])
    if held and string.sub(held, -2) ~= ':w' then
      redis.call('APPEND', KEYS[i], ':w')
    end
  end
end
return false
