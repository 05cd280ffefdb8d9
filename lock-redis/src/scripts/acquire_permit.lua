-- Takes a free permit slot of one semaphore for each of one or more attempts and issues
-- their fencing token, in one atomic step: what acquire_any.lua does for a semaphore's
-- slots, through the semaphore's index (see permits.lua), so that neither a grant nor a
-- refusal reads the slot keys one by one: the first slot the index shows free is found in
-- its bitmap (N bits), and only that slot's key is taken. The attempts of one call (single
-- calls coalesced, as acquires are) share its clock read, its token and its look at the
-- due slots, and are served in order, each as if it came alone after the ones before it.
-- KEYS[1] = the index `<prefix>:{<name>}:permits`, KEYS[2] = its due set (`:due`),
-- KEYS[3] = its waiters' flag (`:waited`), KEYS[4] = the high-water key of the hash slot
-- (as in acquire.lua)
-- ARGV[1] = the slot keys' common part, `<prefix>:{<name>}:permit:`; then six values per
-- attempt: its owner id (hex); its ttl in ms; '1' when other waiters of the client's
-- process wait for this semaphore, '-' to mark nothing (the client's process hears no
-- releases), '0' otherwise (as acquire.lua's ARGV[3]); the first and last slot of the run
-- tried first; the last slot of a second run, from slot 0, tried after it ('-1' for none):
-- the slots asked for, in the order asked (a semaphore asks from slot 0, and for k permits
-- from the slot after the one granted; a caller may ask from any slot onwards, wrapping
-- to 0); last, 'R' when the call is sent again (a client retry after a lost reply)
-- Returns one reply per attempt, in order: {slot, token}, the first slot free in the order
-- asked, taken; or false when every slot it asked for is held (then, unless its mark is
-- '-', the waiters' flag is set, so the next release of a slot is announced on that slot's
-- key as a channel). Sent again, an attempt first returns the slot it took the first time,
-- if it took one.
--
-- The token is issued as in acquire.lua.
local index, due, waited, high_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local slots = ARGV[1]
local attempts = math.floor((#ARGV - 1) / 6)
local again = ARGV[#ARGV] == 'R' and #ARGV == 2 + 6 * attempts

-- One clock read for the due times (ms) and the token (µs).
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

-- When a held slot is next due, from its key's `PTTL` (`left`): when that runs out (0 is
-- this very millisecond: the key expires in the next one), or, for a key without a TTL
-- (set by hand), after the attempt's `ttl`.
local function due_after(left, ttl)
  if left >= 0 then
    return now + left
  end
  return now + ttl
end

-- Slots whose lease was due to run out by now: freed if their key is gone (a TTL ran
-- out, a purge), else due again when their key's TTL (renewed since) runs out. Returns
-- whether a slot the index showed held was freed. Run at most once per call, and only
-- when an attempt would otherwise pass over a slot the index shows held (a grant after
-- its run's first slot, a slot key found held, a refusal): a grant of the run's first
-- slot passes over nothing, whatever is due.
local swept = false
local function sweep(ttl)
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
      redis.call('ZADD', due, due_after(left, ttl), slot)
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

-- The first slot of the run `first..=last`, then `0..=wrapped`, that the index shows free,
-- and whether it is in the second part; or nil. Starts from the lowest clear bit of the
-- whole bitmap, one BITPOS that often answers alone: above the run's last slot, every slot
-- of the run is shown held (the run lies within 0..last, so a full semaphore is refused on
-- this one look); from the run's first slot on, it is the answer; before it, the first
-- part is looked at from its first slot, and the second part's answer is that lowest bit.
local function first_shown_free(first, last, wrapped)
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

-- The token, issued once a slot is to be taken (a call that refuses every attempt issues
-- none), and shared by the call's grants (each is of another slot key).
local token

-- Takes `slot`, the first slot up to `hi` the index shows free, or the next shown free
-- after it whose key is free, for `owner` for `ttl` ms; nil when none is. A slot the index
-- shows free but whose key is held is marked held, and, due slots freed, the next one
-- tried.
local function take(slot, hi, owner, ttl)
  while slot do
    if not token then
      token = next_token(high_key, time)
    end
    local key = slots .. slot
    -- The index first, then the slot key: a user the server refuses one of the index's
    -- commands is refused before this script wrote any slot key, so the client may take
    -- the slot keys without the index instead (see permits.rs).
    redis.call('SETBIT', index, slot, 1)
    redis.call('ZADD', due, now + ttl, slot)
    if redis.call('SET', key, owner .. ':' .. token, 'NX', 'PX', ttl) then
      return slot
    end
    redis.call('ZADD', due, due_after(redis.call('PTTL', key), ttl), slot)
    sweep(ttl)
    slot = first_clear(slot + 1, hi)
  end
  return nil
end

-- One attempt: the slot it took, or nil.
local function attempt(owner, ttl, first, last, wrapped)
  local slot, second = first_shown_free(first, last, wrapped)
  if slot ~= first and sweep(ttl) then
    slot, second = first_shown_free(first, last, wrapped)
  end
  if slot and not second then
    slot = take(slot, last, owner, ttl)
    if not slot and wrapped >= 0 then
      slot = take(first_clear(0, wrapped), wrapped, owner, ttl)
    end
  elseif slot then
    slot = take(slot, wrapped, owner, ttl)
  end
  return slot
end

-- Sent again: the slots the call's attempts took the first time, read once for them all.
local took = {}
if again then
  local owners = {}
  for i = 0, attempts - 1 do
    owners[ARGV[2 + 6 * i]] = true
  end
  took = permits_of(index, slots, owners)
end

local replies = {}
-- The longest TTL of the attempts that set the waiters' flag, if any does.
local flag
for i = 0, attempts - 1 do
  local at = 2 + 6 * i
  local owner, ttl, mark = ARGV[at], tonumber(ARGV[at + 1]), ARGV[at + 2]
  local first, last, wrapped = tonumber(ARGV[at + 3]), tonumber(ARGV[at + 4]), tonumber(ARGV[at + 5])
  local reply = false
  if took[owner] then
    reply = {tonumber(took[owner][1]), string.match(took[owner][2], '^%x+:(%d+)')}
  else
    local slot = attempt(owner, ttl, first, last, wrapped)
    if slot then
      reply = {slot, token}
    end
    if (slot and mark == '1') or (not slot and mark ~= '-') then
      flag = math.max(flag or 0, ttl)
    end
  end
  replies[i + 1] = reply
end
if token then
  redis.call('SET', high_key, token)
end
if flag then
  redis.call('SET', waited, '1', 'PX', flag)
end
return replies
