"""The Redis store's writes, each a Lua script Redis runs as one step (:mod:`.redis_store`).

Every write that adds bytes to an owner's responses counts them in the owner's size hash
(``responses:owner:<owner>:bytes``: each response's bytes, and their total under ``*``), and then
sheds: while the owner is past its count or its byte bound, its oldest responses go, never one
being generated (its lease is held) and never the one just written. A response that expired
is forgotten by the same pass, its bytes given back. Only the owner's own keys are touched, so one
key's writes never cost another key anything. Redis runs with ``noeviction``: it drops nothing
itself; past :data:`FULL` of its ``maxmemory`` no new response is kept (503 ``store_full``), so
the answers already running have the rest to finish in. (The scripts name keys they build from the owner;
the store runs on one Redis primary, not a Redis Cluster.)

Runs in each model replica.
"""

from __future__ import annotations

PREFIX = "responses:"
FULL = 0.9  # past this share of Redis's maxmemory, no new response is kept: the rest is for running answers

_HELPERS = """
local prefix = '@PREFIX@'
local function owned_of(owner) return prefix .. 'owner:' .. owner end
local function sizes_of(owner) return prefix .. 'owner:' .. owner .. ':bytes' end
local function forget(owner, id)
  local sizes = sizes_of(owner)
  local size = tonumber(redis.call('HGET', sizes, id) or '0')
  redis.call('DEL', prefix .. id, prefix .. id .. ':events', prefix .. id .. ':lease')
  redis.call('ZREM', owned_of(owner), id)
  redis.call('HDEL', sizes, id)
  redis.call('HINCRBY', sizes, '*', -size)
end
local function grow(owner, id, by, ttl)
  local sizes = sizes_of(owner)
  redis.call('HINCRBY', sizes, id, by)
  redis.call('HINCRBY', sizes, '*', by)
  redis.call('PEXPIRE', sizes, ttl)
end
local function shed(owner, keep, max_count, max_bytes)
  local owned = owned_of(owner)
  local total = tonumber(redis.call('HGET', sizes_of(owner), '*') or '0')
  local count = redis.call('ZCARD', owned)
  if total <= max_bytes and count <= max_count then return end
  for _, id in ipairs(redis.call('ZRANGE', owned, 0, -1)) do
    if total <= max_bytes and count <= max_count then return end
    if id ~= keep and redis.call('EXISTS', prefix .. id .. ':lease') == 0 then
      total = total - tonumber(redis.call('HGET', sizes_of(owner), id) or '0')
      count = count - 1
      forget(owner, id)
    end
  end
end
""".replace("@PREFIX@", PREFIX)

# KEYS: the response. ARGV: its id, owner, object, background flag, input items, expiry (ms), creation
# time, the owner's count and byte bounds. 1: kept; 0: refused, larger than the byte bound alone;
# -1: refused, Redis past FULL of its maxmemory (the rest is the running answers' room).
SAVE = (
    _HELPERS
    + """
local size = #ARGV[3] + #ARGV[5]
if size > tonumber(ARGV[9]) then return 0 end
local memory = redis.call('INFO', 'memory')
local used = tonumber(string.match(memory, 'used_memory:(%d+)'))
local most = tonumber(string.match(memory, 'maxmemory:(%d+)'))
if most > 0 and used > most * @FULL@ then return -1 end
redis.call('HSET', KEYS[1], 'response', ARGV[3], 'owner', ARGV[2], 'background', ARGV[4], 'input', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
redis.call('ZADD', owned_of(ARGV[2]), ARGV[7], ARGV[1])
redis.call('PEXPIRE', owned_of(ARGV[2]), ARGV[6])
grow(ARGV[2], ARGV[1], size, ARGV[6])
shed(ARGV[2], ARGV[1], tonumber(ARGV[8]), tonumber(ARGV[9]))
return 1
""".replace("@FULL@", str(FULL))
)

# KEYS: the response, its log. ARGV: its id, the sequence number, the event, the expiry (ms), the
# owner's bounds. {1}: appended (or this same event was, by a retried call); {0}: refused (gone, or
# the number is another event's); {2, n}: the log ends at n, before the number's predecessor
# (writes a failover lost).
APPEND = (
    _HELPERS
    + """
local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner then return {0} end
local n = tonumber(ARGV[2])
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local at = -1
if #last > 0 then at = tonumber(string.match(last[1][1], '%-(%d+)$')) - 1 end
if at >= n then
  local same = redis.call('XRANGE', KEYS[2], '0-' .. (n + 1), '0-' .. (n + 1))
  if #same > 0 and same[1][2][2] == ARGV[3] then return {1} end
  return {0}
end
if at < n - 1 then return {2, at} end
redis.call('XADD', KEYS[2], '0-' .. (n + 1), 'e', ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
grow(owner, ARGV[1], #ARGV[3], ARGV[4])
shed(owner, ARGV[1], tonumber(ARGV[5]), tonumber(ARGV[6]))
return {1}
"""
)

# KEYS: the response, its log. ARGV: its id, the new object, its status, the expiry (ms), the owner's
# bounds. 1: updated; 0: refused (gone, or its status final or further on).
UPDATE = (
    _HELPERS
    + """
local stored = redis.call('HGET', KEYS[1], 'response')
local owner = redis.call('HGET', KEYS[1], 'owner')
if not stored or not owner then return 0 end
local order = {queued = 0, in_progress = 1, completed = 2, incomplete = 2, failed = 2, cancelled = 2}
local now = order[cjson.decode(stored).status] or 0
local new = order[ARGV[3]] or 0
if now == 2 or new < now then return 0 end
redis.call('HSET', KEYS[1], 'response', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
grow(owner, ARGV[1], #ARGV[2] - #stored, ARGV[4])
shed(owner, ARGV[1], tonumber(ARGV[5]), tonumber(ARGV[6]))
return 1
"""
)

# KEYS: the response. ARGV: its id. Its keys go, and its owner's count and bytes forget it.
DELETE = (
    _HELPERS
    + """
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner then forget(owner, ARGV[1]) return 1 end
redis.call('DEL', KEYS[1], KEYS[1] .. ':events', KEYS[1] .. ':lease')
return 0
"""
)
