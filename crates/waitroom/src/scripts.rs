//! The Lua scripts that make each multi-key step of the waiting room atomic (Redis runs a
//! script to completion before any other command). Every event script takes the same first
//! eight keys (see [`crate::keys::EventKeys`]) and shares one prelude: the Redis clock (so
//! every API instance measures heartbeats and slots against one clock), the pre-queue opening,
//! the lapse clock and the sweep of abandoned positions. Time values are milliseconds since
//! the Unix epoch.
//!
//! **The lapse clock.** A position lapses when its holder has not polled for `abandon` ms of
//! time in which the waiting room could have answered the poll, not of wall time: spans in
//! which it could not (pauses) do not count. A pause is recorded two ways, by the first
//! script that sees the clock after one (the sweeping scripts `join`, `status`, `release`,
//! `stats`, and `tick_clock`):
//! - a **stall**: the clock was not seen for more than [`crate::STALL_GAP`] (every sweeping
//!   script and every API process's [`TICK_CLOCK`], once a second, sees it; so only a Redis
//!   unreachable or stalled, or no API process running, goes that long): the whole gap since;
//! - a **claim** of refusals: spans in which a process kept refusing the waiting room's
//!   callers ([`crate::Waitroom::note_refused`]), sent with its next sweeping call or
//!   clock tick as ages (`from:to,…`, ms before the call).
//!
//! A pause never holds a lapse back by more than [`crate::LAPSE_GRACE_FACTOR`] × `abandon` in
//! all, so refusals that never end cannot keep abandoned positions for ever; at most
//! [`MAX_SPANS`] pauses are kept, and a cutoff is reused for [`CUTOFF_TTL_MS`], so a poll's
//! work stays bounded. The same cutoff decides every lapse: the sweep, a late poll, a
//! repeated join, the release step and the per-user count of live positions.
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
//! and outside the event: `lapse-clock` hash (`seen`: when the clock was last seen; `spans`:
//! the pauses, `from:to,…` oldest first, merged, those that ended more than an hour (or the
//! longest grace of any caller, `longest`: the longest `abandon` one gave) ago dropped;
//! `cutoff`: `abandon:at:cutoff`, the last cutoff computed from them), `events` set (events
//! with a queue, for the release controller), `t:{T}` hash (ticket → event, user), `u:{U}` zset (a user's live positions in every event → the
//! time the position lapses without pauses) and `us:{U}` zset (their running admission slots
//! → the slot's end), for the per-user limit, `rv:{jti}` (revoked admission tokens).
//! The keys of one user or ticket live outside the event's hash slot: the waiting room needs
//! one Redis primary (not Redis Cluster).

/// The lapse clock, shared by every event script and [`TICK_CLOCK`]; the including script
/// sets `CLOCK` (the `lapse-clock` hash's key) first. `@STALL_GAP_MS@`, `@GRACE_FACTOR@`,
/// `@MAX_SPANS@` and `@CUTOFF_TTL_MS@` are replaced by [`crate::STALL_GAP`],
/// [`crate::LAPSE_GRACE_FACTOR`], [`MAX_SPANS`] and [`CUTOFF_TTL_MS`].
const CLOCK_FNS: &str = r#"
local STALL_GAP_MS, GRACE_FACTOR, MAX_SPANS, CUTOFF_TTL_MS = @STALL_GAP_MS@, @GRACE_FACTOR@, @MAX_SPANS@, @CUTOFF_TTL_MS@

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

@CLOCK_BODY@"#;

/// Opens every event script. `KEYS[1..8]` = meta, q, pre, hb, adm, users, events,
/// lapse-clock; then come [`CLOCK_FNS`] and [`EVENT_FNS`].
const PRELUDE: &str = r#"
local META, Q, PRE, HB, ADM, USERS, EVENTS = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local CLOCK = KEYS[8]
"#;

/// The most pauses the clock keeps: beyond, the two oldest are joined (the time between
/// them becomes a pause too: a longer grace, never a shorter one, and for the oldest the
/// fewest positions), so the work of a poll stays bounded.
pub(crate) const MAX_SPANS: usize = 16;

/// How long a cutoff computed from the pauses is reused, ms: a lapse is decided at most this
/// much later than it could be, and a poll does not walk the pauses again.
pub(crate) const CUTOFF_TTL_MS: u64 = 100;

/// Shared by every event script, after [`PRELUDE`] and [`CLOCK_FNS`].
const EVENT_FNS: &str = r#"
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

-- Drops up to `limit` positions whose last poll is older than `cutoff` (see `lapse_cutoff`),
-- and ended admission slots. Returns the number of positions dropped.
local function sweep(now, cutoff, limit)
  redis.call('ZREMRANGEBYSCORE', ADM, '-inf', now)
  if limit <= 0 then return 0 end
  local dead = redis.call('ZRANGEBYSCORE', HB, '-inf', '(' .. cutoff, 'LIMIT', 0, limit)
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

/// The lapse clock's functions, inside [`CLOCK_FNS`].
const CLOCK_BODY: &str = r#"
-- Pauses as {from, to} pairs, oldest first, from their stored form `from:to,...`.
local function parse_spans(raw)
  local spans = {}
  for a, b in string.gmatch(raw, '(%d+):(%d+)') do spans[#spans + 1] = {tonumber(a), tonumber(b)} end
  return spans
end

local function format_spans(spans)
  local parts = {}
  for i, s in ipairs(spans) do parts[i] = string.format('%d:%d', s[1], s[2]) end
  return table.concat(parts, ',')
end

-- The pauses with [from, to] added: sorted, overlapping ones merged, those that ended by
-- `horizon` dropped, and at most MAX_SPANS (the two oldest joined: they matter least).
local function add_pause(spans, from, to, horizon)
  if to > from then spans[#spans + 1] = {from, to} end
  table.sort(spans, function(x, y) return x[1] < y[1] end)
  local merged = {}
  for _, s in ipairs(spans) do
    if s[2] > horizon then
      local last = merged[#merged]
      if last and s[1] <= last[2] then
        if s[2] > last[2] then last[2] = s[2] end
      else
        merged[#merged + 1] = {s[1], s[2]}
      end
    end
  end
  while #merged > MAX_SPANS do
    merged[1][2] = merged[2][2]
    table.remove(merged, 2)
  end
  return merged
end

-- Walks back from `now` through the pauses, newest first, until `abandon` ms of serving
-- time are behind: the cutoff, never earlier than `floor`.
local function walk_back(spans, now, abandon, floor)
  local remaining, t = abandon, now
  for i = #spans, 1, -1 do
    local from, to = spans[i][1], math.min(spans[i][2], t)
    if from < to then
      if t - to >= remaining then break end
      remaining = remaining - (t - to)
      t = from
    end
  end
  return math.max(t - remaining, floor)
end

-- The lapse clock's step (see the module's doc): records a stall since the clock was last
-- seen and this caller's claim of refusals (`from_age:to_age,...`, ms before now; '' for
-- none), then returns the heartbeat cutoff: a position whose last poll is older than it has
-- gone `abandon` ms of serving time without one, and lapses. Never earlier than
-- `now - (GRACE_FACTOR + 1) * abandon`. Without pauses that is `now - abandon` at the cost
-- of one HMGET and one HSET; with pauses, the cutoff last computed (by any caller) is reused
-- for CUTOFF_TTL_MS when it was computed for the same `abandon` and this call records no
-- pause (a call that records one computes afresh and replaces it, so a reused cutoff is
-- never later, never stricter, than a fresh one: a lapse comes at most CUTOFF_TTL_MS late).
-- Pauses are kept for the longest grace of any caller: those that ended more than an hour
-- ago, or (GRACE_FACTOR + 1) times the longest `abandon` any caller gave if longer, are
-- dropped.
local function lapse_cutoff(now, abandon, claim)
  local floor = now - (GRACE_FACTOR + 1) * abandon
  local c = redis.call('HMGET', CLOCK, 'seen', 'spans', 'cutoff', 'longest')
  local seen, raw = tonumber(c[1]), c[2] or ''
  local longest = tonumber(c[4]) or 0
  if abandon > longest then
    longest = abandon
    redis.call('HSET', CLOCK, 'longest', abandon)
  end
  local horizon = now - math.max(3600000, (GRACE_FACTOR + 1) * longest)
  if not seen or now > seen then redis.call('HSET', CLOCK, 'seen', now) end
  local stalled = seen and now - seen > STALL_GAP_MS
  if not stalled and claim == '' then
    if raw == '' then return now - abandon end
    if c[3] then
      local by, at, cut = string.match(c[3], '^(%d+):(%d+):(%d+)$')
      by, at, cut = tonumber(by), tonumber(at), tonumber(cut)
      if by == abandon and now >= at and now - at < CUTOFF_TTL_MS then return math.max(cut, floor) end
    end
  end
  local spans = parse_spans(raw)
  if stalled then spans = add_pause(spans, seen, now, horizon) end
  for a, b in string.gmatch(claim, '(%d+):(%d+)') do
    a, b = tonumber(a), tonumber(b)
    if a > b and a <= now then spans = add_pause(spans, now - a, now - b, horizon) end
  end
  spans = add_pause(spans, 0, 0, horizon)
  local formatted = format_spans(spans)
  if formatted ~= raw then
    if formatted == '' then redis.call('HDEL', CLOCK, 'spans') else redis.call('HSET', CLOCK, 'spans', formatted) end
  end
  local cutoff = walk_back(spans, now, abandon, floor)
  if formatted ~= '' then redis.call('HSET', CLOCK, 'cutoff', string.format('%d:%d:%d', abandon, now, cutoff)) end
  return cutoff
end
"#;

/// `tick_clock`: the lapse clock's step on its own, run by every API process every second
/// ([`crate::Waitroom::keep_clock`]), so the clock is seen while no queue call runs (a quiet
/// waiting room is no stall) and a process's claim of refusals goes out without waiting for
/// traffic. KEYS[1] = lapse-clock. ARGV: abandon ms, claim of refusals. Returns how far
/// pauses hold lapses back now, ms (0 when none).
const TICK_CLOCK: &str = r#"
local now, abandon = now_ms(), tonumber(ARGV[1])
return now - abandon - lapse_cutoff(now, abandon, ARGV[2])
"#;

/// `join`. KEYS 9 = `t:{new ticket}`, 10 = `u:{user}`, 11 = `us:{user}`. ARGV: event, user,
/// new ticket, abandon ms, sweep limit, max positions per user, ticket key ttl ms, claim of
/// refusals.
/// Returns `{state, ticket, created, position, opens_at, abandoned, slot_end, rate}` where
/// state is `pre`, `queued`, `admitted` or `limit` (then `created` carries the user's live
/// positions) and rate is the live release rate or `''`.
const JOIN: &str = r#"
local event, user, ticket = ARGV[1], ARGV[2], ARGV[3]
local abandon, limit, max_pos, ttl = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local now = now_ms()
local cutoff = lapse_cutoff(now, abandon, ARGV[8])
open_if_due(now)
local dropped = sweep(now, cutoff, limit)
local opening = pending_opening() or -1
local rate = live_rate(now)

-- One position per user and event: a repeated join (a retry after a lost answer) gets the
-- same ticket back.
local existing = redis.call('HGET', USERS, user)
if existing then
  local hb = redis.call('ZSCORE', HB, existing)
  if hb and tonumber(hb) >= cutoff then
    redis.call('ZADD', HB, now, existing)
    redis.call('ZADD', KEYS[10], now + abandon, existing)
    local state = 'queued'
    if redis.call('ZSCORE', PRE, existing) then state = 'pre' end
    return {state, existing, 0, position(existing), opening, dropped, -1, rate}
  end
  local slot = redis.call('ZSCORE', ADM, existing)
  if slot then
    -- Admitted: from the user's positions to their admission slots (as `status` does).
    redis.call('ZREM', KEYS[10], existing)
    redis.call('ZADD', KEYS[11], slot, existing)
    redis.call('PEXPIRE', KEYS[11], ttl)
    return {'admitted', existing, 0, -1, opening, dropped, tonumber(slot), rate}
  end
end

-- The user's live positions (`u`: each one's lapse time without pauses, `hb + abandon`, so
-- it counts while the position is kept) and running admission slots (`us`: each one's end).
redis.call('ZREMRANGEBYSCORE', KEYS[10], '-inf', '(' .. (cutoff + abandon))
redis.call('ZREMRANGEBYSCORE', KEYS[11], '-inf', now)
local held = redis.call('ZCARD', KEYS[10]) + redis.call('ZCARD', KEYS[11])
if held >= max_pos then
  return {'limit', '', held, -1, opening, dropped, -1, rate}
end

redis.call('HSET', KEYS[9], 'event', event, 'user', user)
redis.call('PEXPIRE', KEYS[9], ttl)
redis.call('HSET', USERS, user, ticket)
redis.call('ZADD', KEYS[10], now + abandon, ticket)
redis.call('PEXPIRE', KEYS[10], ttl)
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

/// `status`. KEYS 9 = `t:{ticket}`, 10 = `u:{user}`, 11 = `us:{user}`. ARGV: ticket, user, abandon ms, sweep
/// limit, ticket key ttl ms, claim of refusals. Returns `{state, position, opens_at,
/// abandoned, slot_end, queued, pre_queued, rate}`; state `unknown` when the ticket is not
/// this user's or is gone; rate as in `join`.
const STATUS: &str = r#"
local ticket, user = ARGV[1], ARGV[2]
local abandon, limit, ttl = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local now = now_ms()
local cutoff = lapse_cutoff(now, abandon, ARGV[6])
if redis.call('HGET', KEYS[9], 'user') ~= user then return {'unknown', -1, -1, 0, -1, 0, 0, ''} end
open_if_due(now)
local dropped = sweep(now, cutoff, limit)
local opening = pending_opening() or -1
local rate = live_rate(now)
local slot = redis.call('ZSCORE', ADM, ticket)
if slot then
  -- Admitted: from the user's positions to their admission slots.
  redis.call('ZREM', KEYS[10], ticket)
  redis.call('ZADD', KEYS[11], slot, ticket)
  redis.call('PEXPIRE', KEYS[11], ttl)
  return {'admitted', -1, opening, dropped, tonumber(slot), redis.call('ZCARD', Q), redis.call('ZCARD', PRE), rate}
end
local hb = redis.call('ZSCORE', HB, ticket)
if hb and tonumber(hb) < cutoff then
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
redis.call('ZADD', KEYS[10], now + abandon, ticket)
redis.call('PEXPIRE', KEYS[9], ttl)
local state = 'queued'
if redis.call('ZSCORE', PRE, ticket) then state = 'pre' end
return {state, position(ticket), opening, dropped, -1, redis.call('ZCARD', Q), redis.call('ZCARD', PRE), rate}
"#;

/// `leave`. KEYS 9 = `t:{ticket}`, 10 = `u:{user}`, 11 = `rv:{ticket}`, 12 = `us:{user}`. ARGV: ticket, user.
/// Returns `{1, slot end ms}` when the ticket was this user's and its live admission slot was
/// revoked (the admission token's `jti` is the ticket; revoked until the slot ends), `{1, 0}`
/// when it was this user's without a live slot, else `{0, 0}`.
const LEAVE: &str = r#"
local ticket, user = ARGV[1], ARGV[2]
if redis.call('HGET', KEYS[9], 'user') ~= user then return {0, 0} end
local now = now_ms()
local slot = redis.call('ZSCORE', ADM, ticket)
redis.call('ZREM', Q, ticket)
redis.call('ZREM', PRE, ticket)
redis.call('ZREM', HB, ticket)
redis.call('ZREM', ADM, ticket)
redis.call('ZREM', KEYS[10], ticket)
redis.call('ZREM', KEYS[12], ticket)
if redis.call('HGET', USERS, user) == ticket then redis.call('HDEL', USERS, user) end
redis.call('DEL', KEYS[9])
if slot and tonumber(slot) > now then
  redis.call('SET', KEYS[11], '1', 'PX', math.ceil(tonumber(slot) - now))
  return {1, math.floor(tonumber(slot))}
end
return {1, 0}
"#;

/// `release`. ARGV: event, n, abandon ms, sweep limit, slot ms, rate (positions per second
/// the controller releases this event at, recorded for `join`/`status`; `''` = not given),
/// how long that rate stays valid, ms, claim of refusals.
/// Admits the next `n` live positions, dropping lapsed ones it meets on the way (so an
/// abandoned position never holds the inlet). Returns `{admitted tickets, abandoned, queued, pre_queued, admitted_live,
/// slot_end}`.
const RELEASE: &str = r#"
local event, n = ARGV[1], tonumber(ARGV[2])
local abandon, limit, slot_ms = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local now = now_ms()
local cutoff = lapse_cutoff(now, abandon, ARGV[8])
if ARGV[6] ~= '' then redis.call('HSET', META, 'rate', ARGV[6], 'rate_until', now + tonumber(ARGV[7])) end
open_if_due(now)
local dropped = sweep(now, cutoff, limit)
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

/// `stats`. ARGV: abandon ms, sweep limit, claim of refusals. Returns `{queued, pre_queued,
/// admitted_live, abandoned, now}`.
const STATS: &str = r#"
local now = now_ms()
local abandon = tonumber(ARGV[1])
local cutoff = lapse_cutoff(now, abandon, ARGV[3])
open_if_due(now)
local dropped = sweep(now, cutoff, tonumber(ARGV[2]))
return {redis.call('ZCARD', Q), redis.call('ZCARD', PRE), live_admitted(now), dropped, now}
"#;

/// `schedule`. KEYS 1..8 as usual. ARGV: opens_at ms, seed, explicit seed (`1`/`0`).
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
    pub tick_clock: redis::Script,
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
        let clock = CLOCK_FNS
            .replace("@CLOCK_BODY@", CLOCK_BODY)
            .replace("@STALL_GAP_MS@", &crate::STALL_GAP.as_millis().to_string())
            .replace("@GRACE_FACTOR@", &crate::LAPSE_GRACE_FACTOR.to_string())
            .replace("@MAX_SPANS@", &MAX_SPANS.to_string())
            .replace("@CUTOFF_TTL_MS@", &CUTOFF_TTL_MS.to_string());
        let with_prelude = |body: &str| redis::Script::new(&format!("{PRELUDE}{clock}{EVENT_FNS}\n{body}"));
        Self {
            join: with_prelude(JOIN),
            tick_clock: redis::Script::new(&format!("local CLOCK = KEYS[1]\n{clock}\n{TICK_CLOCK}")),
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
