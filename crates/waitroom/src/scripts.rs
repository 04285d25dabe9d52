//! The Lua scripts that make each multi-key step of the waiting room atomic (Redis runs a
//! script to completion before any other command). Every event script takes the same first
//! seven keys (see [`crate::keys::EventKeys`]) and shares one prelude: the Redis clock (so
//! every API instance measures heartbeats and slots against one clock), the pre-queue opening
//! and the sweep of abandoned positions. Time values are milliseconds since the Unix epoch.
//!
//! Data model, per event `E`:
//! - `meta` hash: `opens_at` (ms, absent = open), `opened` (`1` once the pre-queue was
//!   shuffled in), `seed` (pre-queue draw seed), `seq` and `pre_seq` (counters);
//! - `q` zset: ticket → arrival sequence (FIFO order; position = rank + 1);
//! - `pre` zset: ticket → random draw (pre-queue, moved into `q` in draw order at opening);
//! - `hb` zset: ticket → last poll (heartbeat) of every `q` and `pre` member;
//! - `adm` zset: ticket → end of its admission slot;
//! - `users` hash: user → their ticket in this event (one position per user and event);
//!
//! and outside the event: `events` set (events with a queue, for the release controller), `t:{T}`
//! hash (ticket → event, user), `u:{U}` zset (a user's live positions in every event → the
//! time the position lapses, for the per-user limit), `rv:{jti}` (revoked admission tokens).
//! The keys of one user or ticket live outside the event's hash slot: the waiting room needs
//! one Redis primary (not Redis Cluster).

/// Shared by every event script. `KEYS[1..7]` = meta, q, pre, hb, adm, users, events.
const PRELUDE: &str = r#"
local META, Q, PRE, HB, ADM, USERS, EVENTS = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The opening time while the pre-queue is still closed, else nil.
local function pending_opening()
  local o = redis.call('HGET', META, 'opens_at')
  if o and redis.call('HGET', META, 'opened') ~= '1' then return tonumber(o) end
  return nil
end

-- At the opening, the whole pre-queue enters the queue in draw order (a shuffle decided by
-- the draws, not by arrival), ahead of anyone who joins after the opening.
local function open_if_due(now)
  local o = pending_opening()
  if o == nil or now < o then return end
  local pre = redis.call('ZRANGE', PRE, 0, -1)
  for _, t in ipairs(pre) do
    redis.call('ZADD', Q, redis.call('HINCRBY', META, 'seq', 1), t)
  end
  redis.call('DEL', PRE)
  redis.call('HSET', META, 'opened', '1')
end

-- Drops up to `limit` positions whose holder has not polled for `abandon` ms, and ended
-- admission slots. Returns the number of positions dropped.
local function sweep(now, abandon, limit)
  redis.call('ZREMRANGEBYSCORE', ADM, '-inf', now)
  if limit <= 0 then return 0 end
  local dead = redis.call('ZRANGEBYSCORE', HB, '-inf', '(' .. (now - abandon), 'LIMIT', 0, limit)
  for _, t in ipairs(dead) do
    redis.call('ZREM', Q, t)
    redis.call('ZREM', PRE, t)
    redis.call('ZREM', HB, t)
  end
  return #dead
end

local function position(t)
  local r = redis.call('ZRANK', Q, t)
  if r then return r + 1 end
  return -1
end

local function live_admitted(now)
  return redis.call('ZCOUNT', ADM, '(' .. now, '+inf')
end

-- The release controller's last rate for this event, as a string, or '' once it is past the
-- validity the controller gave it (a controller that stopped says nothing about the wait).
local function live_rate(now)
  local r = redis.call('HMGET', META, 'rate', 'rate_until')
  if r[1] and r[2] and now <= tonumber(r[2]) then return r[1] end
  return ''
end
"#;

/// `join`. KEYS 8 = `t:{new ticket}`, 9 = `u:{user}`. ARGV: event, user, new ticket,
/// abandon ms, sweep limit, max positions per user, ticket key ttl ms.
/// Returns `{state, ticket, created, position, opens_at, abandoned, slot_end, rate}` where
/// state is `pre`, `queued`, `admitted` or `limit` (then `created` carries the user's live
/// positions) and rate is the live release rate or `''`.
const JOIN: &str = r#"
local event, user, ticket = ARGV[1], ARGV[2], ARGV[3]
local abandon, limit, max_pos, ttl = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local now = now_ms()
open_if_due(now)
local dropped = sweep(now, abandon, limit)
local opening = pending_opening() or -1
local rate = live_rate(now)

-- One position per user and event: a repeated join (a retry after a lost answer) gets the
-- same ticket back.
local existing = redis.call('HGET', USERS, user)
if existing then
  local hb = redis.call('ZSCORE', HB, existing)
  if hb and tonumber(hb) >= now - abandon then
    redis.call('ZADD', HB, now, existing)
    redis.call('ZADD', KEYS[9], now + abandon, existing)
    local state = 'queued'
    if redis.call('ZSCORE', PRE, existing) then state = 'pre' end
    return {state, existing, 0, position(existing), opening, dropped, -1, rate}
  end
  local slot = redis.call('ZSCORE', ADM, existing)
  if slot then
    return {'admitted', existing, 0, -1, opening, dropped, tonumber(slot), rate}
  end
end

redis.call('ZREMRANGEBYSCORE', KEYS[9], '-inf', now)
local held = redis.call('ZCARD', KEYS[9])
if held >= max_pos then
  return {'limit', '', held, -1, opening, dropped, -1, rate}
end

redis.call('HSET', KEYS[8], 'event', event, 'user', user)
redis.call('PEXPIRE', KEYS[8], ttl)
redis.call('HSET', USERS, user, ticket)
redis.call('ZADD', KEYS[9], now + abandon, ticket)
redis.call('PEXPIRE', KEYS[9], ttl)
redis.call('ZADD', HB, now, ticket)
redis.call('SADD', EVENTS, event)
if opening >= 0 and now < opening then
  -- Pre-queue: the draw depends only on the event's secret seed and the arrival number, so
  -- arriving first buys nothing, and a known seed reproduces the order.
  local n = redis.call('HINCRBY', META, 'pre_seq', 1)
  local seed = redis.call('HGET', META, 'seed') or ''
  local draw = tonumber(string.sub(redis.sha1hex(seed .. ':' .. n), 1, 13), 16)
  redis.call('ZADD', PRE, draw, ticket)
  return {'pre', ticket, 1, -1, opening, dropped, -1, rate}
end
redis.call('ZADD', Q, redis.call('HINCRBY', META, 'seq', 1), ticket)
return {'queued', ticket, 1, position(ticket), opening, dropped, -1, rate}
"#;

/// `status`. KEYS 8 = `t:{ticket}`, 9 = `u:{user}`. ARGV: ticket, user, abandon ms, sweep
/// limit, ticket key ttl ms. Returns `{state, position, opens_at,
/// abandoned, slot_end, queued, pre_queued, rate}`; state `unknown` when the ticket is not
/// this user's or is gone; rate as in `join`.
const STATUS: &str = r#"
local ticket, user = ARGV[1], ARGV[2]
local abandon, limit, ttl = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if redis.call('HGET', KEYS[8], 'user') ~= user then return {'unknown', -1, -1, 0, -1, 0, 0, ''} end
local now = now_ms()
open_if_due(now)
local dropped = sweep(now, abandon, limit)
local opening = pending_opening() or -1
local rate = live_rate(now)
local slot = redis.call('ZSCORE', ADM, ticket)
if slot then
  redis.call('ZADD', KEYS[9], slot, ticket)
  return {'admitted', -1, opening, dropped, tonumber(slot), redis.call('ZCARD', Q), redis.call('ZCARD', PRE), rate}
end
local hb = redis.call('ZSCORE', HB, ticket)
if hb and tonumber(hb) < now - abandon then
  -- Lapsed but not swept yet: a late poll does not resurrect it.
  redis.call('ZREM', Q, ticket)
  redis.call('ZREM', PRE, ticket)
  redis.call('ZREM', HB, ticket)
  dropped = dropped + 1
  hb = nil
end
if not hb then
  return {'unknown', -1, -1, dropped, -1, 0, 0, ''}
end
redis.call('ZADD', HB, now, ticket)
redis.call('ZADD', KEYS[9], now + abandon, ticket)
redis.call('PEXPIRE', KEYS[8], ttl)
local state = 'queued'
if redis.call('ZSCORE', PRE, ticket) then state = 'pre' end
return {state, position(ticket), opening, dropped, -1, redis.call('ZCARD', Q), redis.call('ZCARD', PRE), rate}
"#;

/// `leave`. KEYS 8 = `t:{ticket}`, 9 = `u:{user}`, 10 = `rv:{ticket}`. ARGV: ticket, user.
/// Returns `{1, slot end ms}` when the ticket was this user's and its live admission slot was
/// revoked (the admission token's `jti` is the ticket; revoked until the slot ends), `{1, 0}`
/// when it was this user's without a live slot, else `{0, 0}`.
const LEAVE: &str = r#"
local ticket, user = ARGV[1], ARGV[2]
if redis.call('HGET', KEYS[8], 'user') ~= user then return {0, 0} end
local now = now_ms()
local slot = redis.call('ZSCORE', ADM, ticket)
redis.call('ZREM', Q, ticket)
redis.call('ZREM', PRE, ticket)
redis.call('ZREM', HB, ticket)
redis.call('ZREM', ADM, ticket)
redis.call('ZREM', KEYS[9], ticket)
if redis.call('HGET', USERS, user) == ticket then redis.call('HDEL', USERS, user) end
redis.call('DEL', KEYS[8])
if slot and tonumber(slot) > now then
  redis.call('SET', KEYS[10], '1', 'PX', math.ceil(tonumber(slot) - now))
  return {1, math.floor(tonumber(slot))}
end
return {1, 0}
"#;

/// `release`. ARGV: event, n, abandon ms, sweep limit, slot ms, rate (positions per second
/// the controller releases this event at, recorded for `join`/`status`; `''` = not given),
/// how long that rate stays valid, ms.
/// Admits the next `n` live positions, dropping lapsed ones it meets on the way (so an
/// abandoned position never holds the inlet). Returns `{admitted tickets, abandoned, queued, pre_queued, admitted_live,
/// slot_end}`.
const RELEASE: &str = r#"
local event, n = ARGV[1], tonumber(ARGV[2])
local abandon, limit, slot_ms = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local now = now_ms()
if ARGV[6] ~= '' then redis.call('HSET', META, 'rate', ARGV[6], 'rate_until', now + tonumber(ARGV[7])) end
open_if_due(now)
local dropped = sweep(now, abandon, limit)
local cutoff = now - abandon
local admitted = {}
while #admitted < n do
  local head = redis.call('ZRANGE', Q, 0, n - #admitted - 1)
  if #head == 0 then break end
  for _, t in ipairs(head) do
    local hb = redis.call('ZSCORE', HB, t)
    redis.call('ZREM', Q, t)
    redis.call('ZREM', HB, t)
    if hb and tonumber(hb) >= cutoff then
      redis.call('ZADD', ADM, now + slot_ms, t)
      admitted[#admitted + 1] = t
    else
      dropped = dropped + 1
    end
  end
end
local queued, pre = redis.call('ZCARD', Q), redis.call('ZCARD', PRE)
if queued == 0 and pre == 0 then redis.call('SREM', EVENTS, event) end
return {admitted, dropped, queued, pre, live_admitted(now), now + slot_ms}
"#;

/// `stats`. ARGV: abandon ms, sweep limit. Returns `{queued, pre_queued, admitted_live,
/// abandoned, now}`.
const STATS: &str = r#"
local now = now_ms()
open_if_due(now)
local dropped = sweep(now, tonumber(ARGV[1]), tonumber(ARGV[2]))
return {redis.call('ZCARD', Q), redis.call('ZCARD', PRE), live_admitted(now), dropped, now}
"#;

/// `schedule`. KEYS 1..7 as usual. ARGV: opens_at ms, seed, explicit seed (`1`/`0`).
/// Returns 1, or 0 when the event has already opened or people are queued FIFO.
const SCHEDULE: &str = r#"
if redis.call('HGET', META, 'opened') == '1' or redis.call('ZCARD', Q) > 0 then return 0 end
redis.call('HSET', META, 'opens_at', ARGV[1])
if ARGV[3] == '1' then
  redis.call('HSET', META, 'seed', ARGV[2])
else
  redis.call('HSETNX', META, 'seed', ARGV[2])
end
return 1
"#;

/// A GCRA rate bucket (generic cell rate algorithm, the token bucket without a refill
/// timer). KEYS[1] = the bucket. ARGV: emission interval ms (1000 / rate), burst.
/// Returns `{allowed (1/0), retry after ms}`.
const BUCKET: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local interval, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1])) or now
if tat < now then tat = now end
local new_tat = tat + interval
local allow_at = new_tat - interval * burst
if allow_at > now then return {0, math.ceil(allow_at - now)} end
redis.call('SET', KEYS[1], string.format('%.3f', new_tat), 'PX', math.ceil(new_tat - now) + 1)
return {1, 0}
"#;

/// Marks the revocation set seeded. KEYS[1] = the seed's guard, KEYS[2] = the marker;
/// ARGV[1] = the seed's token. Only when the guard still holds the token (the Redis that took
/// the seed's first write is the one answering). Returns 1 when marked.
const MARK_SEEDED: &str = r#"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], '1')
redis.call('DEL', KEYS[1])
return 1
"#;

/// Every script, compiled once (`redis::Script` sends `EVALSHA` and loads the script on
/// `NOSCRIPT`).
pub(crate) struct Scripts {
    pub join: redis::Script,
    pub status: redis::Script,
    pub leave: redis::Script,
    pub release: redis::Script,
    pub stats: redis::Script,
    pub schedule: redis::Script,
    pub bucket: redis::Script,
    pub mark_seeded: redis::Script,
}

impl Scripts {
    pub fn new() -> Self {
        let with_prelude = |body: &str| redis::Script::new(&format!("{PRELUDE}\n{body}"));
        Self {
            join: with_prelude(JOIN),
            status: with_prelude(STATUS),
            leave: with_prelude(LEAVE),
            release: with_prelude(RELEASE),
            stats: with_prelude(STATS),
            schedule: with_prelude(SCHEDULE),
            bucket: redis::Script::new(BUCKET),
            mark_seeded: redis::Script::new(MARK_SEEDED),
        }
    }
}
