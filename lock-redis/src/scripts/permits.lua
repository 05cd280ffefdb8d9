-- A semaphore's permit index; put before every script that takes, frees or gives back a
-- permit slot.
--
-- A semaphore's permits are the lock keys of its slots, `<prefix>:{<name>}:permit:<i>`:
-- they are the leases, renewed, released and fenced as any lock. Beside them, under the
-- same hash tag, the semaphore keeps an index, so that taking a permit or being refused
-- one does not read every slot:
--   `<prefix>:{<name>}:permits`         a bitmap, bit i set while slot i is held;
--   `<prefix>:{<name>}:permits:due`     a sorted set, slot i scored with the server time
--                                       (ms) when its lease runs out unless renewed (a
--                                       released slot stays in it until then);
--   `<prefix>:{<name>}:permits:waited`  set while a refused attempt waits to hear of a
--                                       freed slot (it expires after that attempt's TTL).
-- The slot keys are the truth and the index a guide, so the index being behind never
-- grants a held slot: a grant is still `SET NX` on the slot key. A slot the index shows
-- free but held (taken as a plain lock, or an index lost with a restart) is found so by
-- that `SET NX` and marked held; a slot freed without the index hearing it (its TTL ran
-- out, a purge) is marked free once its due time has passed, by the next attempt that
-- would pass over it as held or be refused. The scripts that free a slot
-- (release, abandon) find the index from the slot key's name; the keys share its hash
-- tag, so on a Cluster they are on the slot key's shard.

-- The index of the semaphore whose permit slot `lock` is, and the slot's number, as the
-- bitmap and the sorted set name it; nil for any other key. A slot is a canonical decimal
-- number (`007` is a lock of its own, not slot 7).
local function permit_index(lock)
  if not string.find(lock, '}:permit:', 1, true) then
    return nil
  end
  local index, slot = string.match(lock, '^(.*}):permit:(%d+)$')
  if not index or (#slot > 1 and string.sub(slot, 1, 1) == '0') then
    return nil
  end
  return index .. ':permits', slot
end

-- The indexes a call freed slots of (see permit_freed).
local freed_in = {}

-- Slot `slot` of `index` was freed: the index shows it free. Returns whether a refused
-- attempt waits to hear of it: the flag is cleared by the first slot a call frees of an
-- index, which is the one announced (the next refusal sets it again). A call that frees
-- slots ends with permits_freed. Best effort, as an announcement is: a user the server
-- refuses these commands (an ACL user set up before the index) still releases; the index
-- then frees the slot when its due time has passed. The slot stays in the due set: the
-- next grant of the slot gives it its new due time, and an attempt that looks at due
-- slots drops it once that time has passed with the key gone, so a release costs no
-- `ZREM`.
local function permit_freed(index, slot)
  redis.pcall('SETBIT', index, slot, 0)
  if freed_in[index] then
    return false
  end
  freed_in[index] = true
  return redis.pcall('DEL', index .. ':waited') == 1
end

-- After the last slot a call frees: an index that shows no slot held is deleted with its
-- due set (an idle semaphore keeps no index), once per index, however many of its slots
-- the call freed.
local function permits_freed()
  for index in pairs(freed_in) do
    if redis.pcall('BITCOUNT', index) == 0 then
      redis.pcall('DEL', index, index .. ':due')
    end
  end
end

-- The slots of the index `index` whose keys (`slots` .. slot) hold a lease of one of
-- `owners` (a set of owner ids), as owner id -> {slot, the key's value}; an owner holding
-- none is not in it. Reads the slots of the due set only (the held ones, and the released
-- ones not yet dropped), once however many owners are asked for: for attempts sent again,
-- or given back, whose reply was lost.
local function permits_of(index, slots, owners)
  local found = {}
  for _, slot in ipairs(redis.call('ZRANGE', index .. ':due', 0, -1)) do
    local held = redis.call('GET', slots .. slot)
    local owner = held and string.match(held, '^(%x+):')
    if owner and owners[owner] then
      found[owner] = {slot, held}
    end
  end
  return found
end
