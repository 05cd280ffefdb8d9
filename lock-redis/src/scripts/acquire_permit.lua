-- Takes a free permit slot of one semaphore and issues its fencing token, in one atomic
-- step: what acquire_any.lua does for a semaphore's slots, through the semaphore's index
-- (see permits.lua), so that neither a grant nor a refusal reads the slot keys one by
-- one: the first slot the index shows free is found in its bitmap (N bits), and only
-- that slot's key is taken.
-- KEYS[1] = the index `<prefix>:{<name>}:permits`, KEYS[2] = its due set (`:due`),
-- KEYS[3] = its waiters' flag (`:waited`), KEYS[4] = the high-water key of the hash slot
-- (as in acquire.lua)
-- ARGV[1] = owner id (hex), ARGV[2] = ttl in ms, ARGV[3] = '1' when other waiters of
-- the client's process wait for this semaphore, '-' to mark nothing (the client's
-- process hears no releases), '0' otherwise (as acquire.lua's ARGV[3]);
-- ARGV[4] = the slot keys' common part, `<prefix>:{<name>}:permit:`;
-- ARGV[5], ARGV[6] = the first and last slot of the run tried first; ARGV[7] = the last
-- slot of a second run, from slot 0, tried after it ('-1' for none): the slots asked for,
-- in the order asked (a semaphore asks from a random slot onwards, wrapping to 0);
-- ARGV[8] = 'R' when this attempt is sent again (a client retry after a lost reply)
-- Returns {slot, token}: the first slot free in the order asked, taken. Sent again, it
-- first returns the slot this attempt took the first time, if it took one. Returns nil
-- when every slot asked for is held, and then (unless ARGV[3] is '-') sets the waiters'
-- flag, so the next release of a slot is announced on that slot's key as a channel.
--
-- The token is issued as in acquire.lua.
local index, due, waited, high_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local owner, ttl, mark, slots = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]

if ARGV[8] == 'R' then
  local slot, held = permit_of(index, slots, owner)
  if slot then
    return {tonumber(slot), string.match(held, '^%x+:(%d+)')}
  end
end

-- One clock read for the due times (ms) and the token (µs).
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

-- When a held slot is next due, from its key's `PTTL` (`left`): when that runs out (0 is
-- this very millisecond: the key expires in the next one), or, for a key without a TTL
-- (set by hand), after this attempt's TTL.
local function due_after(now, left)
  if left >= 0 then
    return now + left
  end
  return now + ttl
end

-- Slots whose lease was due to run out by now: freed if their key is gone (a TTL ran
-- out, a purge), else due again when their key's TTL (renewed since) runs out. Returns
-- whether a slot the index showed held was freed. Run at most once per attempt, and only
-- when the attempt would otherwise pass over a slot the index shows held (a grant after
-- the run's first slot, a slot key found held, a refusal): a grant of the run's first
-- slot passes over nothing, whatever is due.
local swept = false
local function sweep()
  if swept then
    return false
  end
  swept = true
  local freed = false
  for _, slot in ipairs(redis.call('ZRANGEBYSCORE', due, '-inf', now)) do
    local left = redis.call('PTTL', slots .. slot)
    if left == -2 then
      redis.call('ZREM', due, slot)
      if redis.call('SETBIT', index, slot, 0) == 1 then
        freed = true
      end
    else
      redis.call('ZADD', due, due_after(now, left), slot)
    end
  end
  return freed
end

-- The first slot from `lo` to `hi` whose bit is clear, or nil. BITPOS starts at a byte,
-- so one BITPOS from `lo`'s byte answers unless it finds a clear bit of that byte before
-- `lo` (or the bitmap is missing: 0); then the bits of the byte from `lo` are read one
-- by one. A bitmap that ends before `lo` (-1) has every bit after its end clear.
local function first_clear(lo, hi)
  if lo > hi then
    return nil
  end
  local found = redis.call('BITPOS', index, 0, math.floor(lo / 8))
  if found >= lo or found == -1 then
    found = math.max(found, lo)
    if found > hi then
      return nil
    end
    return found
  end
  local at = lo
  while at <= hi do
    if at % 8 ~= 0 then
      if redis.call('GETBIT', index, at) == 0 then
        return at
      end
      at = at + 1
    else
      local found = redis.call('BITPOS', index, 0, math.floor(at / 8))
      if found < at then
        found = at
      end
      if found > hi then
        return nil
      end
      return found
    end
  end
  return nil
end

local first, last, wrapped = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])

-- The first slot of the run the index shows free, and whether it is in the second part
-- (from 0), or nil. Starts from the lowest clear bit of the whole bitmap, one BITPOS that
-- often answers alone: above the run's last slot, every slot of the run is shown held (the
-- run lies within 0..last, so a full semaphore is refused on this one look); from the
-- run's first slot on, it is the answer; before it, the first part is looked at from its
-- first slot, and the second part's answer is that lowest bit.
local function first_shown_free()
  local lowest = redis.call('BITPOS', index, 0)
  if lowest > last then
    return nil
  end
  if lowest >= first then
    return lowest, false
  end
  local found = first_clear(first, last)
  if found then
    return found, false
  end
  if lowest <= wrapped then
    return lowest, true
  end
  return nil
end

-- The token, issued once a slot is to be taken (a refusal issues none).
local token, value

-- Takes `slot`, the first slot up to `hi` the index shows free, or the next shown free
-- after it whose key is free; nil when none is. A slot the index shows free but whose key
-- is held is marked held, and, due slots freed, the next one tried.
local function take(slot, hi)
  while slot do
    if not token then
      token = next_token(high_key, time)
      value = owner .. ':' .. token
    end
    local key = slots .. slot
    -- The index first, then the slot key: a user the server refuses one of the index's
    -- commands is refused before this script wrote any slot key, so the client may take
    -- the slot keys without the index instead (see permits.rs).
    redis.call('SETBIT', index, slot, 1)
    redis.call('ZADD', due, now + ttl, slot)
    if redis.call('SET', key, value, 'NX', 'PX', ttl) then
      return slot
    end
    redis.call('ZADD', due, due_after(now, redis.call('PTTL', key)), slot)
    sweep()
    slot = first_clear(slot + 1, hi)
  end
  return nil
end

local slot, second = first_shown_free()
if slot ~= first and sweep() then
  slot, second = first_shown_free()
end
if slot and not second then
  slot = take(slot, last)
  if not slot and wrapped >= 0 then
    slot = take(first_clear(0, wrapped), wrapped)
  end
elseif slot then
  slot = take(slot, wrapped)
end
if slot then
  redis.call('SET', high_key, token)
  if mark == '1' then
    redis.call('SET', waited, '1', 'PX', ttl)
  end
  return {slot, token}
end
if mark ~= '-' then
  redis.call('SET', waited, '1', 'PX', ttl)
end
return false
