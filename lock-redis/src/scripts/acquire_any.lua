-- Takes one free lock of several (a semaphore's permit slots) and issues its fencing
-- token, in one atomic step.
-- KEYS[i] = <prefix>:{<name i>}  (as in acquire.lua)
-- ARGV[1] = owner id (hex), the same for every key of the attempt; ARGV[2] = ttl in ms
-- Returns {i, token}: the first free lock, taken; or, for this very attempt sent again (a
-- client retry after a lost reply), the lock it took the first time, with its token. It
-- looks for that one before it takes anything, so a resent attempt never takes a second
-- lock. Returns nil when another holds every lock, each then marked waited for, as
-- acquire.lua marks one, so its release is announced to the semaphore's waiters.
--
-- The token is the server's clock in microseconds, read once the lock is free, as in
-- acquire.lua.
local free = nil
local unmarked = {}
for i = 1, #KEYS do
  local held = redis.call('GET', KEYS[i])
  if not held then
    free = free or i
  else
    local owner, token, waited = string.match(held, '^(%x+):(%d+)(:?w?)$')
    if owner == ARGV[1] then
      return {i, token}
    end
    if waited == '' then
      unmarked[#unmarked + 1] = i
    end
  end
end
if free then
  local now = redis.call('TIME')
  local token = now[1] .. string.sub('00000' .. now[2], -6)
  redis.call('SET', KEYS[free], ARGV[1] .. ':' .. token, 'PX', ARGV[2])
  return {free, token}
end
-- `APPEND` keeps the key's TTL.
for _, i in ipairs(unmarked) do
  redis.call('APPEND', KEYS[i], ':w')
end
return false
