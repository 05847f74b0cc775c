-- The one Lua script every shared-state operation runs in (a batch of operations per call).
--
-- Redis runs a script atomically, so each operation below is a check-and-reserve with no race
-- between replicas, and a batch of operations costs one round trip. Time comes from the server's
-- `TIME` (replicas' clocks never matter); the optional `at` argument overrides it for tests only.
--
-- ARGV: [1] key prefix (ends with ":"), [2] JSON array of operations, [3] replica id,
-- [4] lease ttl (ms), [5] backlog ttl (ms), [6] "" or a time override in seconds (tests).
-- Reply: a JSON array with one object per operation, in order.
--
-- Keys (all under the prefix, all expiring; a missing bucket is a full one):
--
--     b:<bucket>            hash  l (level), t (updated at, s)         token bucket
--     pl:<pool>             zset  request id -> lease expiry (ms)      pool capacity leases
--     pb:<pool>             hash  request id -> "budget|tenant|owner", _sum = total budget
--     tl:<tenant>           zset  request id -> lease expiry (ms)      tenant concurrency
--     tl:<tenant>:<class>   zset  the same, for an endpoint class with a max_concurrency
--     lease:<request id>    hash  what settlement needs (tenant, pool, estimates, charges...)
--     vtc:<pool>:<rank>     hash  tenant -> virtual token counter, _floor
--     bl:<pool>:<rank>      zset  "tenant|replica" -> expiry (ms)      who waits for the pool
--     w:<pool>              string, short-lived: someone waits for the pool (events wanted)
--     epoch                 string, set once per server lifetime (a new one = the data was lost)
--     ev                    pub/sub channel: "pool|tenant|request id|owner|inflight|tokens"
--                           when capacity comes back (a release, an expired lease) and someone
--                           may care: a process waits for the pool, or the lease's owner is
--                           not the process that released it (it must free its local copy)
--
-- Bucket arithmetic is the same as extproc.scheduler.limits (tests compare them).

local P = ARGV[1]
local ops = cjson.decode(ARGV[2])
local REPLICA = ARGV[3]
local LEASE_TTL = tonumber(ARGV[4])
local BACKLOG_TTL = tonumber(ARGV[5])
local NOW, NOW_MS
if ARGV[6] ~= '' then
  NOW = tonumber(ARGV[6])
  NOW_MS = math.floor(NOW * 1000)
else
  local t = redis.call('TIME')
  NOW = tonumber(t[1]) + tonumber(t[2]) / 1000000
  NOW_MS = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local EPS = 1e-9
local KEY_TTL = math.max(LEASE_TTL * 3, 60000)
local VTC_TTL = 3600000
local EV = P .. 'ev'

local function fmt(x) return string.format('%.17g', x) end
local function num(x, default)
  if x == nil or x == false then return default end
  return tonumber(x)
end

local function want_events(pool)
  redis.call('SET', P .. 'w:' .. pool, 1, 'PX', BACKLOG_TTL * 2)
end

-- token buckets -------------------------------------------------------------------------------

local function level_of(key, cap, rate)
  local v = redis.call('HMGET', P .. 'b:' .. key, 'l', 't')
  if not v[1] then return cap end
  local level, at = tonumber(v[1]), tonumber(v[2])
  if level >= cap then return cap end
  local elapsed = NOW - at
  if elapsed <= 0 then return level end
  return math.min(cap, level + elapsed * rate)
end

local function store_level(key, cap, rate, level)
  local k = P .. 'b:' .. key
  local at = NOW
  local prev = redis.call('HGET', k, 't')
  if prev and tonumber(prev) > NOW then at = tonumber(prev) end
  redis.call('HSET', k, 'l', fmt(level), 't', fmt(at))
  local full_in = 0
  if level < cap then full_in = (cap - level) / rate end
  redis.call('PEXPIRE', k, math.ceil((full_in + (at - NOW)) * 1000) + 1000)
end

local function wait_for(level, cost, rate)
  if level >= cost then return 0 end
  return (cost - level) / rate
end

local function op_take(op)
  local levels = {}
  local never = false
  for i, b in ipairs(op.b) do
    levels[i] = level_of(b[1], b[2], b[3])
    if b[4] > b[2] then never = true end
  end
  if never then return {ok = 0, l = levels, w = -1} end
  local wait = 0
  for i, b in ipairs(op.b) do
    local w = wait_for(levels[i], b[4], b[3])
    if w > wait then wait = w end
  end
  if wait > EPS then return {ok = 0, l = levels, w = wait} end
  for i, b in ipairs(op.b) do
    levels[i] = levels[i] - b[4]
    store_level(b[1], b[2], b[3], levels[i])
  end
  return {ok = 1, l = levels, w = 0}
end

local function op_give(op)
  local level = math.min(op.c, level_of(op.k, op.c, op.r) + op.a)
  store_level(op.k, op.c, op.r, level)
  return {ok = 1, l = level}
end

local function adjust(key, cap, rate, delta)
  local level = math.min(cap, level_of(key, cap, rate) - delta)
  store_level(key, cap, rate, level)
  return level
end

local function op_adjust(op)
  return {ok = 1, l = adjust(op.k, op.c, op.r, op.d)}
end

local function op_level(op)
  return {ok = 1, l = level_of(op.k, op.c, op.r)}
end

-- fair-share counters and the backlog registry ------------------------------------------------

local function vtc_key(pool, rank) return P .. 'vtc:' .. pool .. ':' .. rank end
local function band_key(pool, rank) return P .. 'bl:' .. pool .. ':' .. rank end

local function counter(vk, tenant) return num(redis.call('HGET', vk, tenant), 0) end

local function raise_floor(vk, value)
  if value > num(redis.call('HGET', vk, '_floor'), 0) then
    redis.call('HSET', vk, '_floor', fmt(value))
  end
end

local function tenant_of(member) return string.match(member, '^(.*)|[^|]*$') end

-- The tenants registered as waiting for the pool at this tier (expired entries dropped).
local function band_tenants(pool, rank)
  local bk = band_key(pool, rank)
  local expired = redis.call('ZRANGEBYSCORE', bk, '-inf', NOW_MS)
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', bk, '-inf', NOW_MS)
    if redis.call('ZCARD', bk) == 0 then
      local vk = vtc_key(pool, rank)
      for _, m in ipairs(expired) do raise_floor(vk, counter(vk, tenant_of(m))) end
    end
  end
  local tenants = {}
  for _, m in ipairs(redis.call('ZRANGE', bk, 0, -1)) do tenants[tenant_of(m)] = true end
  return tenants
end

-- VTC counter lift: a tenant that starts waiting gets max(own, least counter of the others
-- waiting), or the band's floor when nobody waits, so idle time is never banked.
local function lift(pool, rank, tenants, tenant)
  local vk = vtc_key(pool, rank)
  local base = nil
  for name, _ in pairs(tenants) do
    if name ~= tenant then
      local c = counter(vk, name)
      if base == nil or c < base then base = c end
    end
  end
  if base == nil then base = num(redis.call('HGET', vk, '_floor'), 0) end
  local value = math.max(num(redis.call('HGET', vk, tenant), base), base)
  redis.call('HSET', vk, tenant, fmt(value))
  redis.call('PEXPIRE', vk, VTC_TTL)
  return value
end

local function op_backlog(op)
  for _, item in ipairs(op.rm or {}) do
    local bk = band_key(item[1], item[2])
    if redis.call('ZREM', bk, item[3] .. '|' .. REPLICA) == 1 and redis.call('ZCARD', bk) == 0 then
      local vk = vtc_key(item[1], item[2])
      raise_floor(vk, counter(vk, item[3]))
    end
  end
  for _, item in ipairs(op.add or {}) do
    local tenants = band_tenants(item[1], item[2])
    if not tenants[item[3]] then lift(item[1], item[2], tenants, item[3]) end
    local bk = band_key(item[1], item[2])
    redis.call('ZADD', bk, NOW_MS + BACKLOG_TTL, item[3] .. '|' .. REPLICA)
    redis.call('PEXPIRE', bk, BACKLOG_TTL * 3)
    want_events(item[1])
  end
  return {ok = 1}
end

-- capacity leases -----------------------------------------------------------------------------

local function pool_counts(pool)
  local total = redis.call('HGET', P .. 'pb:' .. pool, '_sum')
  return redis.call('ZCARD', P .. 'pl:' .. pool), num(total, 0)
end

local function publish(pool, tenant, rid, owner, always)
  if not always and owner == REPLICA and redis.call('EXISTS', P .. 'w:' .. pool) == 0 then
    return
  end
  local n, tok = pool_counts(pool)
  redis.call('PUBLISH', EV, table.concat({pool, tenant, rid, owner, n, tok}, '|'))
end

-- Take a lease out of the capacity sets; 1 if it held capacity (exactly once per lease).
local function drop_lease(pool, rid)
  local pl, pb = P .. 'pl:' .. pool, P .. 'pb:' .. pool
  if redis.call('ZREM', pl, rid) == 0 then return 0, nil, nil end
  local info = redis.call('HGET', pb, rid) or '0||'
  local budget, tenant, owner = string.match(info, '^([^|]*)|([^|]*)|(.*)$')
  redis.call('HDEL', pb, rid)
  redis.call('HINCRBY', pb, '_sum', -tonumber(budget))
  if tenant ~= '' then redis.call('ZREM', P .. 'tl:' .. tenant, rid) end
  local ck = redis.call('HGET', P .. 'lease:' .. rid, 'ck')
  if ck then redis.call('ZREM', P .. ck, rid) end
  return 1, tenant, owner
end

-- Expired leases (their holder stopped renewing them: it crashed or lost Redis) give their
-- capacity back here, whoever looks at the pool next.
local function purge_pool(pool)
  local expired = redis.call('ZRANGEBYSCORE', P .. 'pl:' .. pool, '-inf', NOW_MS)
  for _, rid in ipairs(expired) do
    local freed, tenant, owner = drop_lease(pool, rid)
    if freed == 1 then publish(pool, tenant, rid, owner, true) end
  end
  return #expired
end

local function refuse(why, pool, reclaimed)
  want_events(pool)
  local n, tok = pool_counts(pool)
  return {ok = 0, why = why, n = n, tok = tok, rc = reclaimed}
end

local function op_gate(op)
  local lk = P .. 'lease:' .. op.rid
  local owner = redis.call('HGET', lk, 'owner')
  if owner then
    local n, tok = pool_counts(op.p)
    if owner == REPLICA then return {ok = 1, n = n, tok = tok, rc = 0, again = 1} end
    return {ok = 0, why = 'duplicate', n = n, tok = tok, rc = 0}
  end
  local reclaimed = purge_pool(op.p)
  local n, tok = pool_counts(op.p)
  local tl = P .. 'tl:' .. op.t
  -- A class with its own max_concurrency counts its leases in a set of its own.
  local ck = nil
  if op.cm ~= nil and op.cm > 0 then ck = 'tl:' .. op.t .. ':' .. op.e end
  if op.f ~= 1 then
    if n >= op.pm or tok + op.b > op.pt then return refuse('capacity', op.p, reclaimed) end
    for r = 0, op.k - 1 do
      if next(band_tenants(op.p, r)) ~= nil then return refuse('tier', op.p, reclaimed) end
    end
    if op.mc > 0 then
      redis.call('ZREMRANGEBYSCORE', tl, '-inf', NOW_MS)
      if redis.call('ZCARD', tl) >= op.mc then
        redis.call('ZREM', band_key(op.p, op.k), op.t .. '|' .. REPLICA)
        return refuse('concurrency', op.p, reclaimed)
      end
    end
    if ck then
      redis.call('ZREMRANGEBYSCORE', P .. ck, '-inf', NOW_MS)
      if redis.call('ZCARD', P .. ck) >= op.cm then
        redis.call('ZREM', band_key(op.p, op.k), op.t .. '|' .. REPLICA)
        return refuse('concurrency', op.p, reclaimed)
      end
    end
    local tenants = band_tenants(op.p, op.k)
    local vk = vtc_key(op.p, op.k)
    local mine
    if tenants[op.t] then mine = counter(vk, op.t) else mine = lift(op.p, op.k, tenants, op.t) end
    for name, _ in pairs(tenants) do
      if counter(vk, name) + op.s + EPS < mine then return refuse('fair', op.p, reclaimed) end
    end
  end
  local expires = NOW_MS + LEASE_TTL
  local pl, pb = P .. 'pl:' .. op.p, P .. 'pb:' .. op.p
  redis.call('ZADD', pl, expires, op.rid)
  redis.call('HSET', pb, op.rid, op.b .. '|' .. op.t .. '|' .. REPLICA)
  redis.call('HINCRBY', pb, '_sum', op.b)
  redis.call('ZADD', tl, expires, op.rid)
  redis.call('HSET', lk, 'tenant', op.t, 'pool', op.p, 'rank', op.k, 'budget', op.b,
    'in', op.i, 'out', op.x, 'w', fmt(op.w), 'wi', fmt(op.wi), 'wo', fmt(op.wo),
    'fair', fmt(op.c), 'outc', op.x, 'seen', 0, 'owner', REPLICA, 'att', 0)
  if op.tbs then redis.call('HSET', lk, 'tbs', cjson.encode(op.tbs)) end
  if ck then
    redis.call('HSET', lk, 'ck', ck)
    redis.call('ZADD', P .. ck, expires, op.rid)
    redis.call('PEXPIRE', P .. ck, KEY_TTL)
  end
  redis.call('PEXPIRE', lk, LEASE_TTL * 3 + 60000)
  for _, k in ipairs({pl, pb, tl}) do redis.call('PEXPIRE', k, KEY_TTL) end
  local vk = vtc_key(op.p, op.k)
  redis.call('HINCRBYFLOAT', vk, op.t, fmt(op.c / op.w))
  redis.call('PEXPIRE', vk, VTC_TTL)
  return {ok = 1, n = n + 1, tok = tok + op.b, rc = reclaimed}
end

local FIELDS = {'tenant', 'pool', 'rank', 'budget', 'in', 'out', 'w', 'wi', 'wo', 'fair',
  'outc', 'seen', 'owner', 'att', 'tbk', 'tbc', 'tbr', 'tbs'}

local function record(rid)
  local v = redis.call('HMGET', P .. 'lease:' .. rid, unpack(FIELDS))
  if not v[1] then return nil end
  local rec = {}
  for i, name in ipairs(FIELDS) do rec[name] = v[i] end
  return rec
end

local function charge_fair(rec, cost)
  if cost == 0 then return end
  local vk = vtc_key(rec.pool, rec.rank)
  redis.call('HINCRBYFLOAT', vk, rec.tenant, fmt(cost / tonumber(rec.w)))
  redis.call('PEXPIRE', vk, VTC_TTL)
end

-- Streamed output above what is already charged to the fair share.
local function op_charge(op)
  local rec = record(op.rid)
  if not rec then return {ok = 0} end
  local lk = P .. 'lease:' .. op.rid
  local seen = tonumber(rec.seen) + op.n
  local extra = seen - tonumber(rec.outc)
  redis.call('HSET', lk, 'seen', seen)
  if extra > 0 then
    local cost = tonumber(rec.wo) * extra
    redis.call('HSET', lk, 'outc', seen, 'fair', fmt(tonumber(rec.fair) + cost))
    charge_fair(rec, cost)
  end
  return {ok = 1}
end

-- Release a lease exactly once, settling estimates against real usage when it is known:
-- the token buckets (the tenant's and its class's) and the fair share move from the reserved
-- estimate to the actual.
local function op_release(op)
  local rec = record(op.rid)
  if not rec then return {ok = 0, done = 0} end
  local freed = drop_lease(rec.pool, op.rid)
  if op.ai ~= nil or op.ao ~= nil then
    local input = op.ai or tonumber(rec['in'])
    local output = op.ao or tonumber(rec.out)
    local delta = input + output - tonumber(rec.budget)
    if delta ~= 0 then
      if rec.tbs then
        for _, b in ipairs(cjson.decode(rec.tbs)) do adjust(b[1], b[2], b[3], delta) end
      end
      if rec.tbk then  -- a lease an older script registered: one bucket
        adjust(rec.tbk, tonumber(rec.tbc), tonumber(rec.tbr), delta)
      end
    end
    local fair_out = op.ao or math.max(tonumber(rec.outc), tonumber(rec.seen))
    local final = tonumber(rec.wi) * input + tonumber(rec.wo) * fair_out
    charge_fair(rec, final - tonumber(rec.fair))
  end
  redis.call('DEL', P .. 'lease:' .. op.rid)
  if freed == 1 then publish(rec.pool, rec.tenant, op.rid, rec.owner, false) end
  local n, tok = pool_counts(rec.pool)
  return {ok = 1, done = freed, n = n, tok = tok, p = rec.pool, t = rec.tenant, o = rec.owner}
end

local function op_renew(op)
  local gone = {}
  local expires = NOW_MS + LEASE_TTL
  for _, rid in ipairs(op.rids) do
    local lk = P .. 'lease:' .. rid
    local v = redis.call('HMGET', lk, 'pool', 'tenant', 'ck')
    local pl = v[1] and (P .. 'pl:' .. v[1])
    if pl and redis.call('ZSCORE', pl, rid) then
      redis.call('ZADD', pl, 'XX', expires, rid)
      redis.call('ZADD', P .. 'tl:' .. v[2], 'XX', expires, rid)
      if v[3] then
        redis.call('ZADD', P .. v[3], 'XX', expires, rid)
        redis.call('PEXPIRE', P .. v[3], KEY_TTL)
      end
      redis.call('PEXPIRE', lk, LEASE_TTL * 3 + 60000)
      redis.call('PEXPIRE', pl, KEY_TTL)
      redis.call('PEXPIRE', P .. 'pb:' .. v[1], KEY_TTL)
      redis.call('PEXPIRE', P .. 'tl:' .. v[2], KEY_TTL)
    else
      gone[#gone + 1] = rid
    end
  end
  -- An epoch that changes only when the server lost its data (a restart without persistence):
  -- holders then register their leases again instead of taking them for released.
  local ek = P .. 'epoch'
  redis.call('SET', ek, fmt(NOW) .. '-' .. REPLICA, 'NX')
  redis.call('PEXPIRE', ek, 86400000)
  return {ok = 1, gone = gone, e = redis.call('GET', ek)}
end

local function op_peek(op)
  local reclaimed = purge_pool(op.p)
  local n, tok = pool_counts(op.p)
  return {ok = 1, n = n, tok = tok, rc = reclaimed}
end

-- The accounting stream of a request admitted elsewhere: mark that it took the request over.
local function op_attach(op)
  local lk = P .. 'lease:' .. op.rid
  local v = redis.call('HMGET', lk, 'tenant', 'pool')
  if not v[1] then return {ok = 0} end
  redis.call('HSET', lk, 'att', 1)
  return {ok = 1, t = v[1], p = v[2]}
end

-- The admission stream ended and no accounting stream was seen on its process: release the
-- lease unless an accounting stream on another process took the request over.
local function op_handoff(op)
  local rec = record(op.rid)
  if not rec then return {ok = 1, r = 'gone'} end
  if rec.att == '1' then return {ok = 1, r = 'attached'} end
  local result = op_release({rid = op.rid})
  result.r = 'released'
  return result
end

-- The fast path of an uncontended request: take its buckets and, if that passes, its lease,
-- in one round trip (the process then admits it without asking again).
local function op_take_gate(op)
  local taken = op_take({b = op.bk})
  if taken.ok ~= 1 then return {t = taken} end
  return {t = taken, g = op_gate(op)}
end

local HANDLERS = {
  take = op_take, tg = op_take_gate, give = op_give, adj = op_adjust, lvl = op_level,
  gate = op_gate, rel = op_release, chg = op_charge, renew = op_renew, peek = op_peek,
  bl = op_backlog, att = op_attach, hand = op_handoff,
}

local out = {}
for i, op in ipairs(ops) do
  local handler = HANDLERS[op.o]
  if handler == nil then
    out[i] = {ok = 0, err = 'unknown operation ' .. tostring(op.o)}
  else
    out[i] = handler(op)
  end
end
return cjson.encode(out)
