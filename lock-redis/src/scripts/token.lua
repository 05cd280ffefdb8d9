-- How tokens are issued; put before every script that reads the clock or issues a token.
--
-- A token is one more than the high-water key's, or the server's clock in microseconds
-- when that is higher, and becomes the high-water key's: state first, the clock only as a
-- floor. The high-water key (one per server, or per hash slot on a Cluster) holds the
-- highest token granted to any lock that shares it and never expires, so tokens rise
-- whatever the clock does while it is there; when it is gone (a restart without
-- persistence, FLUSHALL) or behind (a snapshot or a replica that missed the last grants),
-- the clock, which has moved on since, is above what was lost. The clock is built as
-- decimal text, and compared with the high-water token as text (length, then
-- characters), so the common path converts no number; only when the high-water token is
-- not below the clock is it read as a number, one added: Lua numbers are doubles, exact
-- for integers up to 2^53 (a clock in µs reaches that in the year 2255), and '%.0f'
-- prints them without an exponent.

-- The server's clock in microseconds, as decimal text: `now`, a `TIME` reply the script
-- already read, or a new one.
local function clock_us(now)
  now = now or redis.call('TIME')
  local us = now[2]
  if #us < 6 then
    us = string.sub('00000' .. us, -6)
  end
  return now[1] .. us
end

-- The token of a grant whose locks share the high-water key `high_key`, which the caller
-- sets to it once it granted; `now` as clock_us takes it.
local function next_token(high_key, now)
  local token = clock_us(now)
  local high = redis.call('GET', high_key)
  if high and (#high > #token or (#high == #token and high >= token)) and tonumber(high) then
    token = string.format('%.0f', tonumber(high) + 1)
  end
  return token
end

