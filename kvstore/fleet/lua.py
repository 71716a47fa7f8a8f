"""The directory's Lua scripts: each touches only the keys it is given (one namespace's hash tag).

Every script reads values that anyone with write access to Redis may have written, so none of
them assumes a field is a number or a value has the expected shape: a slot field that is not a
canonical decimal below MAX_SLOTS, or a node value that does not start with ``"<digits> <id>"``,
is skipped (or cleared by the janitor), never allowed to raise. A script that raised would fail
the caller's whole batch, and a node that cannot join or heartbeat drops out of the fleet.

The scripts never see the fleet secret: values arrive signed from Python, and the checksum of a
block is compared with its MAC as one opaque prefix (a node's own value is deterministic).
"""

from __future__ import annotations

from kvstore.fleet.records import HOLDER_PREFIX_BYTES, MAX_SLOTS

# P: bytes before a holders value's bitmap (checksum + MAC). slot_of: a field as a slot, or nil.
_PREAMBLE = f"""
local P = {HOLDER_PREFIX_BYTES}
local MAX_SLOTS = {MAX_SLOTS}
local function slot_of(field)
  if type(field) ~= 'string' or #field > #tostring(MAX_SLOTS) or not string.match(field, '^%d+$') then return nil end
  if #field > 1 and string.sub(field, 1, 1) == '0' then return nil end
  local s = tonumber(field)
  if s < MAX_SLOTS then return s end
  return nil
end
"""

# KEYS[1] holders. ARGV: slot, 'a' (add) | 'r' (remove), hash length, packed hashes, packed values
# for adds: the signed prefix (P bytes) + tier code. Returns the number of checksum conflicts.
PUBLISH = _PREAMBLE + """
local slot = slot_of(ARGV[1])
if not slot then return 0 end
local add = ARGV[2] == 'a'
local L = tonumber(ARGV[3])
local hs = ARGV[4]
local vs = ARGV[5]
local W = P + 1
local bi = P + 1 + math.floor(slot / 4)
local shift = (slot % 4) * 2
local both = bit.lshift(3, shift)
local hold = bit.lshift(1, shift)
local conflicts = 0
for i = 0, #hs / L - 1 do
  local h = string.sub(hs, i * L + 1, (i + 1) * L)
  local v = redis.call('HGET', KEYS[1], h)
  if add then
    local cs = string.sub(vs, i * W + 1, i * W + P)
    local flag = hold
    if string.byte(vs, i * W + W) >= 2 then flag = both end
    local skip = false
    if not v then
      v = cs
    elseif string.sub(v, 1, P) ~= cs then
      if string.find(v, '[^%z]', P + 1) then
        skip = true
        conflicts = conflicts + 1
      else
        v = cs .. string.sub(v, P + 1)
      end
    end
    if not skip then
      if #v < bi then v = v .. string.rep('\\0', bi - #v) end
      local b = bit.bor(bit.band(string.byte(v, bi), bit.bnot(both)), flag)
      redis.call('HSET', KEYS[1], h, string.sub(v, 1, bi - 1) .. string.char(b) .. string.sub(v, bi + 1))
    end
  elseif v and #v >= bi then
    local b = bit.band(string.byte(v, bi), bit.bnot(both))
    v = string.sub(v, 1, bi - 1) .. string.char(b) .. string.sub(v, bi + 1)
    if string.find(v, '[^%z]', P + 1) then
      redis.call('HSET', KEYS[1], h, v)
    else
      redis.call('HDEL', KEYS[1], h)
    end
  end
end
return conflicts
"""

# KEYS[1] holders. ARGV: hash length, packed hashes, dead slots... Clears those slots' bits.
SWEEP = _PREAMBLE + """
local L = tonumber(ARGV[1])
local hs = ARGV[2]
local slots = {}
for j = 3, #ARGV do
  local s = slot_of(ARGV[j])
  if s then slots[#slots + 1] = s end
end
local cleared = 0
for i = 0, #hs / L - 1 do
  local h = string.sub(hs, i * L + 1, (i + 1) * L)
  local v = redis.call('HGET', KEYS[1], h)
  if v then
    local changed = false
    for _, slot in ipairs(slots) do
      local bi = P + 1 + math.floor(slot / 4)
      local mask = bit.lshift(3, (slot % 4) * 2)
      if #v >= bi and bit.band(string.byte(v, bi), mask) ~= 0 then
        v = string.sub(v, 1, bi - 1) .. string.char(bit.band(string.byte(v, bi), bit.bnot(mask))) .. string.sub(v, bi + 1)
        changed = true
      end
    end
    if changed then
      cleared = cleared + 1
      if string.find(v, '[^%z]', P + 1) then redis.call('HSET', KEYS[1], h, v) else redis.call('HDEL', KEYS[1], h) end
    end
  end
end
return cleared
"""

# KEYS[1] nodes. ARGV: node id, the slot the caller signed its value for, that value. The value is
# written only if that slot is the lowest free one; earlier incarnations of the node become dead.
# Returns the slot, or -(lowest free + 1) to say "sign for that slot and ask again"
# (-(MAX_SLOTS + 1) when every slot is taken).
JOIN = _PREAMBLE + """
local all = redis.call('HGETALL', KEYS[1])
local used = {}
for i = 1, #all, 2 do
  local s = slot_of(all[i])
  if s then used[s] = true end
end
local s = 0
while s < MAX_SLOTS and used[s] do s = s + 1 end
if s ~= tonumber(ARGV[2]) then return -(s + 1) end
for i = 1, #all, 2 do
  local e, id = string.match(all[i + 1], '^(%d+) (%S+)')
  if id == ARGV[1] and slot_of(all[i]) then
    redis.call('HSET', KEYS[1], all[i], '0' .. string.sub(all[i + 1], #e + 1))
  end
end
redis.call('HSET', KEYS[1], tostring(s), ARGV[3])
return s
"""

# KEYS[1] nodes, KEYS[2] holders, KEYS[3] revoked. ARGV: slot, new value, keep ms, node id, address.
# Refreshes the slot's value if it is still this node's and alive; 0 means "your slot is gone: join
# again". A revoked key that is not a hash (it would fail every route) is deleted.
HEARTBEAT = _PREAMBLE + """
local v = redis.call('HGET', KEYS[1], ARGV[1])
local ok = 0
if v then
  local e, id, addr = string.match(v, '^(%d+) (%S+) (%S+)')
  if e and id == ARGV[4] and addr == ARGV[5] and tonumber(e) > 0 then
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
    ok = 1
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
local t = redis.call('TYPE', KEYS[3])['ok']
if t ~= 'hash' and t ~= 'none' then redis.call('DEL', KEYS[3]) end
return ok
"""

# KEYS[1] nodes. ARGV: now ms, grace ms. Marks slots expired for longer than grace as dead
# (expiry 0) and returns every dead slot; a slot whose value is unreadable counts as dead, and a
# field that is no slot at all is deleted (nothing can be swept for it).
CLAIM_DEAD = _PREAMBLE + """
local all = redis.call('HGETALL', KEYS[1])
local dead = {}
local limit = tonumber(ARGV[1]) - tonumber(ARGV[2])
for i = 1, #all, 2 do
  if not slot_of(all[i]) then
    redis.call('HDEL', KEYS[1], all[i])
  else
    local e = string.match(all[i + 1], '^(%d+) ')
    local exp = tonumber(e)
    if not exp or exp < limit then
      if exp and exp > 0 then redis.call('HSET', KEYS[1], all[i], '0' .. string.sub(all[i + 1], #e + 1)) end
      dead[#dead + 1] = all[i]
    end
  end
end
return dead
"""
