//! Seat holds: the hold transaction of design §5 and hold expiry of §11.
//!
//! Invariant 1 (one active hold per seat) is protected three ways: seat rows are locked in
//! ascending id order before anything is read, only holds that are `active` *and* past their
//! expiry are reclaimed (under their own row lock, so a hold the saga is confirming is never
//! reclaimed), and the partial unique index `hold_seat_active_uq` rejects any second
//! unreleased row whatever path wrote it. Invariant 3 (HTTP idempotency) is the
//! `idempotency_keys` row: read under the buyer's lock, after which no request of the same
//! buyer and event can commit, and written with its answer by the hold's last statement, its
//! primary key guarding a request with the same key for another event; a failed hold writes
//! no key, so only successful holds are remembered. A retry that may no longer place a hold
//! (its admission ended) is answered from that row alone ([`replay`]).
//!
//! A hold's lifetime follows [`boxoffice_domain::hold`] (case C19): `open_payment_window`
//! pushes `expires_at` when the order becomes payable, [`protect_authorized`] keeps a hold
//! whose authorization was reported in time until the saga settles it, [`check_lapsing`]
//! asks the provider before a payable hold with no authorization lapses, and every test of
//! "lapsed" reads every end at once ([`LAPSED`]).

use crate::error::constraint;
use crate::{outbox, StoreError, Tx};
use boxoffice_domain::{
    saga, Envelope, EventId, HoldId, HoldPolicy, HoldStatus, OrderId, OrderStatus, SeatId, UserId,
};
use chrono::{DateTime, Utc};
use rand::Rng;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use std::collections::HashMap;
use std::time::Duration;
use uuid::Uuid;

/// The end of a hold, with `$p` (`""` or `"h."`) in front of each column: the latest of
/// its expiry, the protection of an authorization reported in time, the ceiling a hold not
/// payable yet may wait, and the wait for the provider's word (PostgreSQL's `GREATEST`
/// ignores NULL). Rules of [`boxoffice_domain::hold`].
macro_rules! hold_end {
    ($p:literal) => {
        concat!(
            "GREATEST(",
            $p,
            "expires_at, ",
            $p,
            "authorized_until, ",
            $p,
            "payable_by, ",
            $p,
            "provider_check_until)"
        )
    };
}
pub(crate) use hold_end;

/// The buyer's lock for an event ([`reserve`]'s step 1, [`replay`]): a transaction-scoped
/// advisory lock on (event `$1`, user `$2`).
macro_rules! buyer_lock {
    () => {
        "pg_advisory_xact_lock(hashtextextended($1::text || '/' || $2::text, 0))"
    };
}

/// The end of a hold (on `holds` unqualified); see [`LAPSED`].
pub const HOLD_END: &str = hold_end!("");

/// The one SQL test of a lapsed hold (on `holds` unqualified): past every end of
/// [`HOLD_END`] by the database clock.
pub const LAPSED: &str = concat!(hold_end!(""), " < clock_timestamp()");

/// Fewest and most seats one hold may take (design §5).
pub const SEATS_PER_HOLD: std::ops::RangeInclusive<usize> = 1..=8;
/// How long an idempotency key is remembered.
pub const IDEMPOTENCY_RETENTION_HOURS: i64 = 24;
/// Attempts of the whole transaction on serialization failure / deadlock.
pub const MAX_ATTEMPTS: u32 = 6;

/// One hold request, already authenticated and admitted.
#[derive(Debug, Clone)]
pub struct ReserveRequest {
    /// The buyer.
    pub user_id: UserId,
    /// The event whose seats are requested.
    pub event_id: EventId,
    /// 1–8 seats; duplicates are ignored and the list is sorted before locking.
    pub seat_ids: Vec<SeatId>,
    /// The client's `Idempotency-Key` header.
    pub idempotency_key: String,
    /// Correlation id for the buyer journey (copied onto every saga event).
    pub correlation_id: Uuid,
    /// Hold time to live.
    pub ttl: Duration,
    /// How long after its creation the hold may wait to become payable before it lapses
    /// (rule 1 of [`boxoffice_domain::hold`]: the ceiling); `None`: it lapses at `ttl`
    /// whether payable or not.
    pub payable_within: Option<Duration>,
    /// The purchase cell the admission token routed the buyer to (this process's cell).
    pub cell: String,
    /// The directory epoch the admission token was minted at: the event must be `active` for
    /// `cell` at exactly this epoch in this ledger ([`crate::cells::Placement::admits`]).
    pub directory_epoch: i64,
    /// How the hold asks for the order's authorization: in its `HoldCreated` (the default)
    /// or by a `PaymentAuthorizationRequested` beside it, for builds that need the command
    /// ([`saga::AuthorizationRequest`]).
    pub authorization_request: saga::AuthorizationRequest,
}

impl ReserveRequest {
    /// Seats deduplicated and sorted: the lock order.
    pub fn normalized_seats(&self) -> Vec<SeatId> {
        let mut s = self.seat_ids.clone();
        s.sort();
        s.dedup();
        s
    }

    /// SHA-256 over the event and the normalized seat set: two bodies naming the same seats
    /// are the same request ([`request_hash`]).
    pub fn request_hash(&self) -> String {
        request_hash(self.event_id, &self.seat_ids)
    }
}

/// SHA-256 (hex) over `event` and `seats` deduplicated and sorted: what an idempotency key
/// stores of its request, so that the same key with another body is told apart.
pub fn request_hash(event: EventId, seats: &[SeatId]) -> String {
    let mut seats = seats.to_vec();
    seats.sort();
    seats.dedup();
    let mut h = Sha256::new();
    h.update(event.0.as_bytes());
    for s in seats {
        h.update(s.0.as_bytes());
    }
    hex::encode(h.finalize())
}

/// The stored answer to a retry that may no longer place a hold (its admission slot has
/// ended, or its token was revoked; invariant 3): `user`'s `key`, read under the buyer's lock
/// for `event` (the one [`reserve`] takes), so a hold of that key still in flight has
/// committed or rolled back by then. Writes nothing.
/// `Ok(Some(receipt))` when the key holds the answer to this event and these seats,
/// `Ok(None)` when the key is unknown (or pruned after [`IDEMPOTENCY_RETENTION_HOURS`]);
/// [`ReserveError::IdempotencyConflict`] when it answered another body,
/// [`ReserveError::InProgress`] when it holds no answer.
pub async fn replay(
    pool: &PgPool,
    user: UserId,
    event: EventId,
    seats: &[SeatId],
    key: &str,
) -> Result<Option<HoldReceipt>, ReserveError> {
    let mut tx = pool.begin().await?;
    // Its own statement: a statement reads with the snapshot it started with, before the wait.
    sqlx::query(concat!("SELECT ", buyer_lock!())).bind(event.0).bind(user.0).execute(&mut *tx).await?;
    let row: Option<KeyRow> = sqlx::query_as(
        "SELECT request_hash, response FROM idempotency_keys WHERE user_id = $1 AND idempotency_key = $2",
    )
    .bind(user.0)
    .bind(key)
    .fetch_optional(&mut *tx)
    .await?;
    tx.rollback().await?;
    remembered_answer(row, &request_hash(event, seats))
}

/// The hold as returned to the client (202 body), stored verbatim with the idempotency key
/// so that a retry returns the original response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HoldReceipt {
    /// The new order (also in `Location: /orders/{order_id}`).
    pub order_id: OrderId,
    /// The hold owning the seats.
    pub hold_id: HoldId,
    /// The event.
    pub event_id: EventId,
    /// Order status at creation: `held`.
    pub status: OrderStatus,
    /// Held seats, sorted.
    pub seat_ids: Vec<SeatId>,
    /// When the hold lapses unless payment is authorized first (RFC 3339, UTC).
    pub expires_at: DateTime<Utc>,
    /// Sum of seat prices in minor units.
    pub amount_minor: i64,
    /// Lower-case ISO 4217 currency.
    pub currency: String,
}

/// The result of a successful call.
#[derive(Debug, Clone, PartialEq)]
pub enum ReserveOutcome {
    /// This call created the hold.
    Created(HoldReceipt),
    /// The same user sent the same key and body before; this is the original receipt.
    Replayed(HoldReceipt),
}

impl ReserveOutcome {
    /// The receipt, whichever call created it.
    pub fn receipt(&self) -> &HoldReceipt {
        match self {
            ReserveOutcome::Created(r) | ReserveOutcome::Replayed(r) => r,
        }
    }
}

/// Why a hold was refused.
#[derive(Debug, thiserror::Error)]
pub enum ReserveError {
    /// At least one seat is held or sold: nothing was held (all-or-nothing). → 409
    #[error("{} seat(s) unavailable", seat_ids.len())]
    SeatUnavailable {
        /// The seats that are taken.
        seat_ids: Vec<SeatId>,
    },
    /// The key was used before by this user with a different body. → 409
    #[error("idempotency key reused with a different request")]
    IdempotencyConflict,
    /// Another request with the same key committed while this one ran (one for another
    /// event: its key's primary key refused ours; the next attempt answers from the key), an
    /// expired key was pruned between the transaction's reads, or the key's row holds no
    /// answer (which no build commits). The transaction is retried; → 409, retryable, when
    /// the attempts run out.
    #[error("a request with this idempotency key is in progress")]
    InProgress,
    /// Some seat ids do not belong to the event. → 422
    #[error("{} seat(s) do not exist for this event", seat_ids.len())]
    UnknownSeats {
        /// The offending ids.
        seat_ids: Vec<SeatId>,
    },
    /// The event does not exist. → 404
    #[error("event not found")]
    EventNotFound,
    /// Seat count outside 1–8. → 422
    #[error("a hold takes 1 to 8 seats, got {0}")]
    SeatCount(usize),
    /// The hold would take the buyer past one of the event's per-buyer limits. → 409
    #[error("buyer limit {limit} reached: {has} of {max}")]
    BuyerLimit {
        /// Which limit.
        limit: BuyerLimit,
        /// The event's maximum.
        max: i64,
        /// What the buyer has now (seats, or active holds), without this request.
        has: i64,
    },
    /// The event's sales window has not opened (or was never scheduled). → 403
    #[error("sales are not open")]
    SalesNotOpen {
        /// When they open, if scheduled.
        opens_at: Option<DateTime<Utc>>,
    },
    /// The event's sales window has closed. → 403
    #[error("sales are closed")]
    SalesClosed,
    /// Another purchase cell sells the event (it moved, or the request reached the wrong
    /// cell). → 409 `event_in_another_cell`
    #[error("event is sold by purchase cell {cell}")]
    EventInAnotherCell {
        /// The cell that sells it.
        cell: String,
        /// At which directory epoch.
        directory_epoch: i64,
    },
    /// The admission token was minted at another directory epoch (before a move). → 409
    /// `admission_token_stale_epoch`
    #[error("admission token minted at another directory epoch")]
    StaleDirectoryEpoch {
        /// The event's epoch here.
        directory_epoch: i64,
    },
    /// The event is being moved to another cell; no holds until the move ends. → 503
    /// `event_moving`
    #[error("the event is moving to another purchase cell")]
    EventMoving,
    /// The database failed (after retries for transient errors). → 503 or 500
    #[error("database error")]
    Db(#[from] sqlx::Error),
    /// A fault point fired (`hold.before_commit` / `hold.after_commit`). → 503
    #[error(transparent)]
    Fault(#[from] boxoffice_faults::Injected),
    /// A ledger row contradicted its own rules (a corrupt row or a refused status move while
    /// reclaiming a lapsed hold). → 500
    #[error(transparent)]
    Ledger(StoreError),
}

impl From<crate::cells::Refusal> for ReserveError {
    fn from(r: crate::cells::Refusal) -> Self {
        use crate::cells::Refusal;
        match r {
            Refusal::ElsewhereCell { cell, directory_epoch } => {
                Self::EventInAnotherCell { cell, directory_epoch }
            }
            Refusal::StaleEpoch { directory_epoch } => Self::StaleDirectoryEpoch { directory_epoch },
            Refusal::Moving => Self::EventMoving,
        }
    }
}

impl From<StoreError> for ReserveError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Db(e) => ReserveError::Db(e),
            other => ReserveError::Ledger(other),
        }
    }
}

/// The per-buyer limits an event stores (`events.max_seats_per_buyer`,
/// `events.max_active_holds_per_buyer`; case C13).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuyerLimit {
    /// Seats across the buyer's active holds, live orders and tickets of the event.
    MaxSeatsPerBuyer,
    /// Active (unexpired, unconfirmed) holds of the buyer in the event.
    MaxActiveHoldsPerBuyer,
}

impl BuyerLimit {
    /// The limit's name, as stored and as shown in problem details.
    pub fn as_str(self) -> &'static str {
        match self {
            BuyerLimit::MaxSeatsPerBuyer => "max_seats_per_buyer",
            BuyerLimit::MaxActiveHoldsPerBuyer => "max_active_holds_per_buyer",
        }
    }
}

impl std::fmt::Display for BuyerLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Runs the hold transaction, retrying the whole transaction with jittered backoff on a
/// transient database error (serialization failure, deadlock, a lost connection; not the
/// region fence's refusal, [`crate::region::refusal`]) or a concurrent request with the same
/// key ([`ReserveError::InProgress`]).
pub async fn reserve(pool: &PgPool, req: &ReserveRequest) -> Result<ReserveOutcome, ReserveError> {
    let seats = req.normalized_seats();
    if !SEATS_PER_HOLD.contains(&seats.len()) {
        return Err(ReserveError::SeatCount(seats.len()));
    }
    let hash = req.request_hash();
    let mut attempt = 0;
    loop {
        attempt += 1;
        let result = reserve_once(pool, req, &seats, &hash).await;
        let retry = match &result {
            // A fenced region's refusal is final for the hold: the buyer gets 503
            // `region_fenced` at once, not after attempts that each lock the seats again.
            Err(ReserveError::Db(e)) => crate::is_retryable(e) && crate::region::refusal(e).is_none(),
            Err(ReserveError::InProgress) => true,
            _ => false,
        };
        if !retry || attempt >= MAX_ATTEMPTS {
            if retry {
                metrics::counter!("boxoffice_hold_retries_exhausted_total").increment(1);
            }
            return result;
        }
        metrics::counter!("boxoffice_hold_retries_total").increment(1);
        let base = 5u64 << attempt.min(5);
        let jitter = rand::thread_rng().gen_range(0..=base);
        tokio::time::sleep(Duration::from_millis(base / 2 + jitter)).await;
    }
}

/// One attempt of the hold transaction, as named steps in the ledger's lock order, three
/// statements between `BEGIN` and `COMMIT`: the region fence's lock and the buyer's, the
/// event's rules and the seat rows locked ([`lock_buyer_and_seats`]); the idempotency key,
/// the buyer's holdings and the seats' current owners, read after those locks
/// ([`read_after_locks`]): a key seen before answers from memory, the event's rules are
/// judged, lapsed holds are reclaimed; then the order, hold, seats, `HoldCreated` (with the
/// authorization request in it or beside it) and the key with its stored answer in one
/// statement ([`insert_hold`]).
async fn reserve_once(
    pool: &PgPool,
    req: &ReserveRequest,
    seats: &[SeatId],
    hash: &str,
) -> Result<ReserveOutcome, ReserveError> {
    let mut tx = pool.begin().await?;
    let LockedEvent { key_seen, rules, rows } = lock_buyer_and_seats(&mut tx, req, seats).await?;
    let seen = read_after_locks(&mut tx, req, seats).await?;
    if key_seen && seen.key.is_none() {
        // Step 1 saw the key and locked no seats; an expired key was pruned since. The next
        // attempt locks them.
        return Err(ReserveError::InProgress);
    }
    // The key first: a retry is answered whatever the rules say now (invariant 3).
    if let Some(replayed) = remembered_answer(seen.key, hash)? {
        return Ok(ReserveOutcome::Replayed(replayed));
    }
    check_rules(rules, &seen.holdings, req, seats.len())?;
    let locked = rows.seats(seats)?;
    take_seats_from_lapsed_holds(&mut tx, seats, seen.owners).await?;
    let receipt = insert_hold(&mut tx, req, hash, seats, &locked, seen.now).await?;
    boxoffice_faults::check("hold.before_commit")?;
    tx.commit().await?;
    // Committed but unanswered: the client's retry with the same key gets this receipt.
    boxoffice_faults::check("hold.after_commit")?;
    Ok(ReserveOutcome::Created(receipt))
}

/// The event's rules as step 1 read them ([`lock_buyer_and_seats`]); the buyer's holdings
/// are step 2's ([`Holdings`]).
struct EventRules {
    purchase_cell: String,
    directory_epoch: i64,
    /// As stored; parsed when the rules are judged, after the key (a replay is answered
    /// whatever it says).
    cell_state: String,
    max_seats_per_buyer: i32,
    max_active_holds_per_buyer: i32,
    sales_open_at: Option<DateTime<Utc>>,
    sales_close_at: Option<DateTime<Utc>>,
    now: DateTime<Utc>,
}

/// What the buyer has in the event, read after their lock ([`read_after_locks`]).
struct Holdings {
    seats_held: i64,
    active_holds: i64,
    tickets: i64,
}

/// A seat row locked by the hold transaction.
struct LockedSeat {
    price_minor: i64,
    currency: String,
}

/// Step 1's answer: the event's rules and the requested seats it found and locked; none
/// when it saw the request's key (`key_seen`).
struct LockedEvent {
    key_seen: bool,
    rules: EventRules,
    rows: LockedRows,
}

/// The requested seats step 1 found and locked, in id order, column by column.
struct LockedRows {
    ids: Vec<Uuid>,
    prices: Vec<i64>,
    currencies: Vec<String>,
    elsewhere: Vec<bool>,
}

impl LockedRows {
    /// The requested seats as locked: unknown seats refuse (422), and so do seats another
    /// cell's ledger sold before the event moved here (`seats.sold_in_cell`, 409 like any
    /// taken seat).
    fn seats(self, seats: &[SeatId]) -> Result<Vec<LockedSeat>, ReserveError> {
        if self.ids.len() != seats.len() {
            let found: std::collections::HashSet<Uuid> = self.ids.into_iter().collect();
            return Err(ReserveError::UnknownSeats {
                seat_ids: seats.iter().filter(|s| !found.contains(&s.0)).copied().collect(),
            });
        }
        let sold_elsewhere: Vec<SeatId> =
            self.ids.iter().zip(&self.elsewhere).filter(|(_, e)| **e).map(|(id, _)| SeatId(*id)).collect();
        if !sold_elsewhere.is_empty() {
            return Err(ReserveError::SeatUnavailable { seat_ids: sold_elsewhere });
        }
        Ok(self
            .prices
            .into_iter()
            .zip(self.currencies)
            .map(|(price_minor, currency)| LockedSeat { price_minor, currency })
            .collect())
    }
}

/// Step 1, one statement: the region fence's lock and the buyer's lock for this event, then
/// the requested seats of the event locked in id order, `FOR NO KEY UPDATE`, with the event's
/// rules.
///
/// The locks, in this order, in the statement's `FROM` (nested subqueries, so the inner one
/// runs first), before any row lock: the `locked` CTE is read while the event's row is
/// projected, after the join that takes them.
/// - The fence's lock ([`crate::region::FENCE_LOCK`]), shared, as the fence check of the
///   first write takes it: a hold queues behind a pending fence before it locks anything, so
///   a writer already past the fence that needs one of its seats never waits for it while
///   it waits for the fence.
/// - The buyer's: a transaction-scoped advisory lock on (event, user). One buyer's
///   concurrent holds of an event run one after the other, so N requests with N keys can
///   never pass the buyer's limits together, and a retry with the same key waits for the
///   first request and reads its answer in step 2.
///
/// Every hold takes them before any row lock, so two holds never wait on each other in
/// opposite orders.
///
/// A request whose key this statement's snapshot shows (a retry) locks no seats: it is
/// answered from the key in step 2 and waits for no other buyer's hold. The snapshot
/// predates the buyer's lock, so it can miss a key (step 2 reads it), never show one step 2
/// does not, unless an expired key was pruned in between ([`reserve_once`] retries).
///
/// The seat lock's strength: it excludes every other hold transaction of these seats (and a
/// cell import's update of them), which is what makes step 2's read of their owners final. It
/// does not exclude the `FOR KEY SHARE` lock a foreign key takes on a seat when a ticket or a
/// hold's seat row is inserted for it: a ticket issue for several orders in one transaction
/// (a shared consumer batch) takes its seats in order-id order, not seat-id order, so with
/// `FOR UPDATE` a request naming seats of two of its orders could lock one and wait for the
/// other while the batch waits for the first, a deadlock PostgreSQL breaks only after
/// `deadlock_timeout`. No ticket issue needs to wait for a hold request: it acts on a
/// confirmed hold's seats, which step 2 finds taken.
///
/// The rules ([`check_rules`]): the event exists (404, at once), this ledger sells it for
/// the token's cell at the token's directory epoch (read without a row lock: a move waits for
/// every transaction older than its freeze, `cells::wait_for_transactions_before`), and its
/// sales window by the database clock.
async fn lock_buyer_and_seats(
    tx: &mut Tx<'_>,
    req: &ReserveRequest,
    seats: &[SeatId],
) -> Result<LockedEvent, ReserveError> {
    type Row = (
        i32,
        i32,
        Option<DateTime<Utc>>,
        Option<DateTime<Utc>>,
        DateTime<Utc>,
        String,
        i64,
        String,
        Vec<Uuid>,
        Vec<i64>,
        Vec<String>,
        Vec<bool>,
        bool,
    );
    let seat_uuids: Vec<Uuid> = seats.iter().map(|s| s.0).collect();
    let row: Option<Row> = sqlx::query_as(concat!(
        "WITH key_seen AS MATERIALIZED (
            SELECT EXISTS (SELECT 1 FROM idempotency_keys WHERE user_id = $2 AND idempotency_key = $4) AS seen
         ), locked AS MATERIALIZED (
            SELECT id, price_minor, currency, sold_in_cell IS NOT NULL AS elsewhere FROM seats
             WHERE event_id = $1 AND id = ANY($3) AND NOT (SELECT seen FROM key_seen)
             ORDER BY id FOR NO KEY UPDATE)
         SELECT e.max_seats_per_buyer, e.max_active_holds_per_buyer, e.sales_open_at, e.sales_close_at,
                clock_timestamp(), e.purchase_cell, e.directory_epoch, e.cell_state,
                ARRAY(SELECT id FROM locked ORDER BY id),
                ARRAY(SELECT price_minor FROM locked ORDER BY id),
                ARRAY(SELECT currency FROM locked ORDER BY id),
                ARRAY(SELECT elsewhere FROM locked ORDER BY id),
                (SELECT seen FROM key_seen)
           FROM (SELECT ",
        buyer_lock!(),
        "
                   FROM (SELECT pg_advisory_xact_lock_shared($5, $6)) fence) buyer_lock,
                events e
          WHERE e.id = $1",
    ))
    .bind(req.event_id.0)
    .bind(req.user_id.0)
    .bind(&seat_uuids)
    .bind(&req.idempotency_key)
    .bind(crate::region::FENCE_LOCK.0)
    .bind(crate::region::FENCE_LOCK.1)
    .fetch_optional(&mut **tx)
    .await?;
    let Some(r) = row else {
        return Err(ReserveError::EventNotFound);
    };
    Ok(LockedEvent {
        key_seen: r.12,
        rules: EventRules {
            purchase_cell: r.5,
            directory_epoch: r.6,
            cell_state: r.7,
            max_seats_per_buyer: r.0,
            max_active_holds_per_buyer: r.1,
            sales_open_at: r.2,
            sales_close_at: r.3,
            now: r.4,
        },
        rows: LockedRows { ids: r.8, prices: r.9, currencies: r.10, elsewhere: r.11 },
    })
}

/// The idempotency key's row, if the user sent the key before: its request hash and stored
/// answer.
type KeyRow = (String, Option<sqlx::types::Json<HoldReceipt>>);

/// A seat's current owner as step 2 read it.
struct Owner {
    seat: SeatId,
    /// The hold and its order (`None` for a ticket).
    hold: Option<(OrderId, HoldId)>,
    /// An `active` hold past every end ([`LAPSED`]); never true for a ticket.
    lapsed: bool,
}

/// Step 2's answer.
struct AfterLocks {
    /// The database clock once the locks were granted: the hold's times count from it.
    now: DateTime<Utc>,
    key: Option<KeyRow>,
    holdings: Holdings,
    owners: Vec<Owner>,
}

/// Step 2, one statement whose snapshot is taken after step 1's locks were granted: the
/// idempotency key, the buyer's holdings in the event and the seats' current owners, with
/// the clock.
///
/// - The key: it sees the answer of every request with this key that committed before, and
///   so every one of this event (they took the buyer's lock before us). A request with this
///   key for another event may be running beside us; the key's primary key settles it in
///   step 3 ([`insert_hold`]).
/// - The holdings ([`check_rules`]): no hold of this buyer for this event can commit while
///   we hold their lock, so the counts cannot grow under us.
/// - The owners: a seat's unreleased hold (with its order, and whether it lapsed) or its
///   valid ticket. A ticket issue may run beside us (our `FOR NO KEY UPDATE` does not exclude
///   its foreign key's share lock, [`lock_buyer_and_seats`]); whether or not it has committed
///   when the snapshot is taken, its seats show as taken (the confirmed hold's unreleased
///   seats, or the tickets). Each hold is read by primary key alone and its lapse computed
///   from the row: a `status = 'active'` filter would invite the partial expiry index, which
///   holds every active hold during an onsale.
async fn read_after_locks(
    tx: &mut Tx<'_>,
    req: &ReserveRequest,
    seats: &[SeatId],
) -> Result<AfterLocks, ReserveError> {
    type Row = (
        DateTime<Utc>,
        Option<String>,
        Option<sqlx::types::Json<HoldReceipt>>,
        i64,
        i64,
        i64,
        Vec<Uuid>,
        Vec<Option<Uuid>>,
        Vec<Option<Uuid>>,
        Vec<bool>,
    );
    let seat_uuids: Vec<Uuid> = seats.iter().map(|s| s.0).collect();
    let r: Row = sqlx::query_as(concat!(
        "WITH owners AS (
            SELECT hs.seat_id, hs.hold_id,
                   (SELECT h.order_id FROM holds h WHERE h.id = hs.hold_id),
                   COALESCE((SELECT h.status = 'active' AND ",
        hold_end!("h."),
        " < clock_timestamp()
                               FROM holds h WHERE h.id = hs.hold_id), false) AS lapsed
              FROM hold_seats hs WHERE hs.seat_id = ANY($1) AND hs.released_at IS NULL
            UNION ALL
            SELECT t.seat_id, NULL, NULL, false FROM tickets t WHERE t.seat_id = ANY($1) AND t.seat_released_at IS NULL)
         SELECT clock_timestamp(), k.request_hash, k.response,
                (SELECT count(*) FROM orders o JOIN holds h ON h.order_id = o.id
                   JOIN hold_seats hs ON hs.hold_id = h.id AND hs.released_at IS NULL
                  WHERE o.event_id = $2 AND o.user_id = $3 AND h.status IN ('active', 'confirmed')),
                (SELECT count(*) FROM orders o JOIN holds h ON h.order_id = o.id
                  WHERE o.event_id = $2 AND o.user_id = $3 AND h.status = 'active'),
                (SELECT count(*) FROM orders o JOIN tickets t ON t.order_id = o.id
                  WHERE o.event_id = $2 AND o.user_id = $3 AND t.voided_at IS NULL),
                ARRAY(SELECT seat_id FROM owners), ARRAY(SELECT hold_id FROM owners),
                ARRAY(SELECT order_id FROM owners), ARRAY(SELECT lapsed FROM owners)
           FROM (SELECT 1) one
           LEFT JOIN idempotency_keys k ON k.user_id = $3 AND k.idempotency_key = $4",
    ))
    .bind(&seat_uuids)
    .bind(req.event_id.0)
    .bind(req.user_id.0)
    .bind(&req.idempotency_key)
    .fetch_one(&mut **tx)
    .await?;
    let owners =
        r.6.into_iter()
            .zip(r.7)
            .zip(r.8)
            .zip(r.9)
            .map(|(((seat, hold), order), lapsed)| Owner {
                seat: SeatId(seat),
                hold: order.zip(hold).map(|(o, h)| (OrderId(o), HoldId(h))),
                lapsed,
            })
            .collect();
    Ok(AfterLocks {
        now: r.0,
        key: r.1.map(|hash| (hash, r.2)),
        holdings: Holdings { seats_held: r.3, active_holds: r.4, tickets: r.5 },
        owners,
    })
}

/// The idempotency key as step 2 read it, against this request's `hash`: a fresh key
/// (`None`) goes on to the hold; a key seen before answers from memory (`Some(receipt)`), or
/// refuses a different body (409 `idempotency_key_conflict`). A key without an answer, which
/// this build never commits, is refused as in progress (409, retryable).
fn remembered_answer(key: Option<KeyRow>, hash: &str) -> Result<Option<HoldReceipt>, ReserveError> {
    match key {
        None => Ok(None),
        Some((stored_hash, _)) if stored_hash != hash => Err(ReserveError::IdempotencyConflict),
        Some((_, Some(r))) => Ok(Some(r.0)),
        Some((_, None)) => Err(ReserveError::InProgress),
    }
}

/// The event's rules against the request, judged in this order: this ledger sells the
/// event for the token's cell at the token's directory epoch (409 `event_in_another_cell` /
/// `admission_token_stale_epoch`, 503 `event_moving`), its sales window is open (403
/// `sales_not_open` / `sales_closed`), and the buyer stays within the event's limits (409
/// `buyer_limit_reached`): seats across the buyer's unreleased `active` or `confirmed` holds,
/// plus valid tickets, plus `requested` must not exceed `max_seats_per_buyer`; `active` holds
/// must stay below `max_active_holds_per_buyer`. A hold past its expiry still counts until the
/// expiry releases it: the saga may be confirming it right now (it decided under its own row
/// lock, before the lapse, and has not committed), so only a released hold gives its seats
/// back to the buyer's allowance. The rules are judged before the seats, as if they had been
/// read first.
fn check_rules(
    rules: EventRules,
    holdings: &Holdings,
    req: &ReserveRequest,
    requested: usize,
) -> Result<(), ReserveError> {
    let state = crate::cells::CellState::try_from(rules.cell_state)
        .map_err(|e| ReserveError::Ledger(StoreError::Corrupt(e)))?;
    crate::cells::Placement { cell: rules.purchase_cell, directory_epoch: rules.directory_epoch, state }
        .admits(&req.cell, req.directory_epoch)?;
    match rules.sales_open_at {
        Some(open) if open <= rules.now => {}
        opens_at => return Err(ReserveError::SalesNotOpen { opens_at }),
    }
    if rules.sales_close_at.is_some_and(|close| close <= rules.now) {
        return Err(ReserveError::SalesClosed);
    }
    let has = holdings.seats_held + holdings.tickets;
    if has + requested as i64 > i64::from(rules.max_seats_per_buyer) {
        return Err(ReserveError::BuyerLimit {
            limit: BuyerLimit::MaxSeatsPerBuyer,
            max: rules.max_seats_per_buyer.into(),
            has,
        });
    }
    if holdings.active_holds >= i64::from(rules.max_active_holds_per_buyer) {
        return Err(ReserveError::BuyerLimit {
            limit: BuyerLimit::MaxActiveHoldsPerBuyer,
            max: rules.max_active_holds_per_buyer.into(),
            has: holdings.active_holds,
        });
    }
    Ok(())
}

/// All or nothing, from step 2's owners: any seat sold or held by a live hold refuses the
/// request (409); holds that are `active` but past expiry are reclaimed
/// ([`reclaim_if_lapsed`]: the expiry's own routine under the hold's row lock, which
/// re-checks status and expiry; a hold that expired meanwhile counts as reclaimed), one after
/// another in ascending order id: each takes its hold's lock and then its order's, so the
/// sequence is the ledger's lock order, the one a saga batch takes the same rows in
/// ([`lock_all_with_orders`]); in hold-id order the two could wait for each other.
async fn take_seats_from_lapsed_holds(
    tx: &mut Tx<'_>,
    seats: &[SeatId],
    owners: Vec<Owner>,
) -> Result<(), ReserveError> {
    let live: Vec<SeatId> = owners.iter().filter(|o| !o.lapsed).map(|o| o.seat).collect();
    if !live.is_empty() {
        return Err(ReserveError::SeatUnavailable { seat_ids: live });
    }
    // Every owner here is a lapsed hold (a ticket or a hold-less row is never lapsed).
    let mut lapsed: Vec<(OrderId, HoldId)> = owners.into_iter().filter_map(|o| o.hold).collect();
    lapsed.sort();
    lapsed.dedup();
    for (_, hold) in lapsed {
        if !reclaim_if_lapsed(tx, hold).await? {
            // Confirmed, extended or released between our read and its lock: the seat is
            // taken (or, rarely, freed by a payment failure: see `reclaim_if_lapsed`).
            return Err(ReserveError::SeatUnavailable { seat_ids: seats.to_vec() });
        }
    }
    Ok(())
}

/// Step 3, one statement: the order (`held`), its `active` hold expiring `req.ttl` after `now`
/// (the database clock once the seats were locked), the hold's seat rows, the facts of
/// [`saga::hold_created`] in the outbox (`HoldCreated` as the order's authorization request,
/// or with `PaymentAuthorizationRequested` after it, per `req.authorization_request`), and the
/// idempotency key with the answer a retry returns (invariant 3), remembered for
/// [`IDEMPOTENCY_RETENTION_HOURS`]. The foreign keys are checked at the statement's end.
///
/// The key is written once, with its answer, by this plain insert: a failed hold writes no
/// key, so only successful holds are remembered. Its primary key (user, key) is the last
/// guard of invariant 3: a request with this key for another event, running beside us under
/// its own buyer's lock, makes the insert wait for it; if it committed, the insert fails
/// and the attempt is retried ([`ReserveError::InProgress`]), whose step 2 reads its answer.
///
/// The outbox rows are written here as [`outbox::insert_all`] writes facts (same columns,
/// `created_at` one microsecond apart in order, the current span's trace context), so the hold
/// costs one round trip for all its writes.
async fn insert_hold(
    tx: &mut Tx<'_>,
    req: &ReserveRequest,
    hash: &str,
    seats: &[SeatId],
    locked: &[LockedSeat],
    now: DateTime<Utc>,
) -> Result<HoldReceipt, ReserveError> {
    let order_id = OrderId::new();
    let hold_id = HoldId::new();
    let amount_minor: i64 = locked.iter().map(|r| r.price_minor).sum();
    let currency = locked[0].currency.clone();
    let seat_uuids: Vec<Uuid> = seats.iter().map(|s| s.0).collect();
    let expires_at = now + chrono::Duration::milliseconds(req.ttl.as_millis() as i64);
    let payable_by = req.payable_within.map(|d| now + chrono::Duration::milliseconds(d.as_millis() as i64));
    let receipt = HoldReceipt {
        order_id,
        hold_id,
        event_id: req.event_id,
        status: OrderStatus::Held,
        seat_ids: seats.to_vec(),
        expires_at,
        amount_minor,
        currency: currency.clone(),
    };
    // `HoldCreated` and, in the older form, the saga's first command (the saga decides what
    // they are: `saga::hold_created`); each later fact is caused by the first.
    let mut events = saga::hold_created(
        order_id,
        hold_id,
        req.event_id,
        seats.to_vec(),
        expires_at,
        amount_minor,
        currency.clone(),
        req.authorization_request,
    )
    .into_iter();
    let created =
        Envelope::new(order_id, &events.next().expect("HoldCreated first"), req.correlation_id, None);
    let followers: Vec<Envelope> = events.map(|e| created.follow(&e)).collect();
    let facts: Vec<&Envelope> = std::iter::once(&created).chain(&followers).collect();
    let fact_ids: Vec<Uuid> = facts.iter().map(|e| e.event_id).collect();
    let fact_types: Vec<&str> = facts.iter().map(|e| e.event_type.as_str()).collect();
    let fact_payloads: Vec<serde_json::Value> =
        facts.iter().map(|e| serde_json::to_value(e).expect("envelopes serialize")).collect();
    let inserted = sqlx::query(
        "WITH new_order AS (
            INSERT INTO orders (id, user_id, event_id, status, amount_minor, currency, correlation_id)
            VALUES ($1, $2, $3, $4, $5, $6, $7)
         ), new_hold AS (
            INSERT INTO holds (id, order_id, status, expires_at, payable_by)
            VALUES ($8, $1, $9, $10, $11)
         ), new_seats AS (
            INSERT INTO hold_seats (hold_id, seat_id) SELECT $8, unnest($12::uuid[])
         ), facts AS (
            INSERT INTO outbox (id, topic, message_key, event_type, payload, created_at, traceparent)
            SELECT f.id, $13, $1::text, f.t, f.p, clock_timestamp() + f.n * interval '1 microsecond', $17
              FROM unnest($14::uuid[], $15::text[], $16::jsonb[]) WITH ORDINALITY AS f(id, t, p, n)
         )
         INSERT INTO idempotency_keys (user_id, idempotency_key, request_hash, order_id, response_status,
                                       response, expires_at)
         VALUES ($2, $18, $20, $1, 202, $19, now() + make_interval(hours => $21))",
    )
    .bind(order_id.0)
    .bind(req.user_id.0)
    .bind(req.event_id.0)
    .bind(OrderStatus::Held.as_str())
    .bind(amount_minor)
    .bind(&currency)
    .bind(req.correlation_id)
    .bind(hold_id.0)
    .bind(HoldStatus::Active.as_str())
    .bind(expires_at)
    .bind(payable_by)
    .bind(&seat_uuids)
    .bind(boxoffice_domain::Topic::Purchase.name())
    .bind(&fact_ids)
    .bind(&fact_types)
    .bind(&fact_payloads)
    .bind(boxoffice_trace::current_traceparent())
    .bind(&req.idempotency_key)
    .bind(sqlx::types::Json(&receipt))
    .bind(hash)
    .bind(IDEMPOTENCY_RETENTION_HOURS as i32)
    .execute(&mut **tx)
    .await;
    match inserted {
        Ok(_) => {
            outbox::wake_relay();
            Ok(receipt)
        }
        // A request with this key for another event committed under us: the next attempt
        // reads its answer (a different body: 409 `idempotency_key_conflict`).
        Err(e) if constraint(&e) == Some("idempotency_keys_pkey") => Err(ReserveError::InProgress),
        // Only reachable if some path took a seat without its row lock: the index is the
        // last guard, and we report it as the conflict it is.
        Err(e) if constraint(&e) == Some("hold_seat_active_uq") => {
            metrics::counter!("boxoffice_hold_unique_index_rejections_total").increment(1);
            Err(ReserveError::SeatUnavailable { seat_ids: seats.to_vec() })
        }
        Err(e) => Err(e.into()),
    }
}

/// A hold as locked by a worker.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct HoldRow {
    /// Hold id.
    pub id: Uuid,
    /// Owning order.
    pub order_id: Uuid,
    /// Stored status; [`transition`] keeps it current.
    #[sqlx(try_from = "String")]
    pub status: HoldStatus,
    /// Expiry instant.
    pub expires_at: DateTime<Utc>,
    /// Whether the hold is lapsed ([`LAPSED`]: past `expires_at` and any protection of a
    /// reported authorization) by the database clock at lock time.
    pub lapsed: bool,
}

/// [`lock_all_with_orders`] for a run of facts, one entry per entry of `orders`, in its order:
/// the pair of the first entry of each order that has a hold; `None` for an order without a
/// hold or that does not exist (its caller takes [`lock_with_order`]'s path) and for a
/// repeated order (an earlier fact's effect may change its rows: its caller locks them again
/// when its turn comes).
pub async fn lock_each_with_order(
    tx: &mut Tx<'_>,
    orders: &[OrderId],
) -> Result<Vec<Option<(HoldRow, crate::orders::OrderRow)>>, StoreError> {
    let mut distinct = orders.to_vec();
    distinct.sort();
    distinct.dedup();
    let mut locked: HashMap<Uuid, (HoldRow, crate::orders::OrderRow)> =
        lock_all_with_orders(tx, &distinct).await?.into_iter().map(|(h, o)| (o.id, (h, o))).collect();
    // The first entry of an order takes its pair; a later one finds it gone.
    Ok(orders.iter().map(|o| locked.remove(&o.0)).collect())
}

/// Locks the holds of `orders` (`FOR UPDATE`) in one statement, in ascending order id (the
/// order a consumer's shared batch applies its messages in); returns the order ids whose hold
/// it locked, in that order (an order without a hold is left out). For a writer that locks
/// the holds of a batch first, as [`lock_for_order`] locks one.
pub async fn lock_all_for_orders(tx: &mut Tx<'_>, orders: &[OrderId]) -> Result<Vec<Uuid>, sqlx::Error> {
    if orders.is_empty() {
        return Ok(Vec::new());
    }
    if let [order] = orders {
        // One order: a plain key lookup.
        return sqlx::query_scalar("SELECT order_id FROM holds WHERE order_id = $1 FOR UPDATE")
            .bind(order.0)
            .fetch_all(&mut **tx)
            .await;
    }
    // Each key looked up and locked on its own, in the array's (ascending) order: see "Lookups
    // by keys" in the crate's documentation.
    let mut ids: Vec<Uuid> = orders.iter().map(|o| o.0).collect();
    ids.sort();
    ids.dedup();
    sqlx::query_scalar(
        "SELECT h.order_id FROM unnest($1::uuid[]) WITH ORDINALITY AS k(order_id, n)
          CROSS JOIN LATERAL (SELECT order_id FROM holds WHERE order_id = k.order_id FOR UPDATE) h
          ORDER BY k.n",
    )
    .bind(&ids)
    .fetch_all(&mut **tx)
    .await
}

/// Locks the hold of `order` (`FOR UPDATE`); first step of every saga transition (lock order
/// hold → order).
pub async fn lock_for_order(tx: &mut Tx<'_>, order: OrderId) -> Result<Option<HoldRow>, sqlx::Error> {
    lock_where(tx, "order_id", order.0).await
}

/// Locks the hold of `order` and then the order (`FOR UPDATE`, the ledger's lock order) in
/// one statement: `None` when the order does not exist, `(None, order)` when it has no hold
/// (a corrupt row the saga refuses where it needs one). The first step of every saga
/// transition and of ticket issuance.
pub async fn lock_with_order(
    tx: &mut Tx<'_>,
    order: OrderId,
) -> Result<Option<(Option<HoldRow>, crate::orders::OrderRow)>, StoreError> {
    match lock_all_with_orders(tx, &[order]).await?.pop() {
        Some((hold, order)) => Ok(Some((Some(hold), order))),
        // No hold (or no order): the order alone, as the callers' two-step path read it.
        None => Ok(crate::orders::lock(tx, order).await?.map(|o| (None, o))),
    }
}

/// The columns [`lock_all_with_orders`] reads, in [`LockedPair`]'s order.
type LockedPair = (Uuid, Uuid, String, DateTime<Utc>, bool, Uuid, Uuid, String, i64, String, Uuid);

/// [`lock_with_order`] for several orders in one statement: locks each order's hold and then
/// the order, in ascending order id (the order a consumer's shared batch applies its facts
/// in, so two batches never wait for each other in a cycle), and returns the pairs found, in
/// that order. An order without a hold, or that does not exist, is left out: its caller
/// takes [`lock_with_order`]'s path for it. `orders` should not repeat an id (a repeated one
/// is returned once).
pub async fn lock_all_with_orders(
    tx: &mut Tx<'_>,
    orders: &[OrderId],
) -> Result<Vec<(HoldRow, crate::orders::OrderRow)>, StoreError> {
    // Row marks are taken order by order in ascending order id (the array form looks each key
    // up and locks it on its own, in the sorted array's order: see "Lookups by keys" in the
    // crate's documentation), and within an order in the order `FOR UPDATE OF` names them:
    // hold, then order.
    // `lapsed` is computed outside the locking query, from each row as locked: a later row's
    // test is not made before the lock waits of the rows before it, and no row's before its
    // own lock wait.
    // The statement for a given selection (optionally inside an opening and a closing part),
    // built at compile time (no formatting per call).
    macro_rules! locking {
        ($selection:literal $(, $open:literal, $close:literal)?) => {
            concat!(
                "WITH locked AS MATERIALIZED (",
                $($open,)?
                "
                    SELECT h.id, h.order_id, h.status, h.expires_at, h.authorized_until, h.payable_by,
                           h.provider_check_until, o.user_id, o.event_id, o.status AS order_status,
                           o.amount_minor, o.currency, o.correlation_id
                      FROM holds h JOIN orders o ON o.id = h.order_id
                     WHERE ",
                $selection,
                "
                       FOR UPDATE OF h, o",
                $($close,)?
                ")
                 SELECT id, order_id, status, expires_at, ",
                hold_end!(""),
                " < clock_timestamp() AS lapsed,
                        user_id, event_id, order_status, amount_minor, currency, correlation_id
                   FROM locked ORDER BY order_id"
            )
        };
    }
    let rows: Vec<LockedPair> = match orders {
        [] => return Ok(Vec::new()),
        // One order (a fact processed alone, a run of one): a plain key lookup.
        [order] => sqlx::query_as(locking!("h.order_id = $1")).bind(order.0).fetch_all(&mut **tx).await?,
        _ => {
            let mut ids: Vec<Uuid> = orders.iter().map(|o| o.0).collect();
            ids.sort();
            ids.dedup();
            sqlx::query_as(locking!(
                "h.order_id = k.order_id",
                "SELECT l.* FROM unnest($1::uuid[]) WITH ORDINALITY AS k(order_id, n) CROSS JOIN LATERAL (",
                ") l"
            ))
            .bind(&ids)
            .fetch_all(&mut **tx)
            .await?
        }
    };
    let corrupt = |e: boxoffice_domain::status::UnknownStatus| StoreError::Corrupt(e.to_string());
    rows.into_iter()
        .map(|r| {
            let hold = HoldRow {
                id: r.0,
                order_id: r.1,
                status: HoldStatus::try_from(r.2).map_err(corrupt)?,
                expires_at: r.3,
                lapsed: r.4,
            };
            let order = crate::orders::OrderRow {
                id: r.1,
                user_id: r.5,
                event_id: r.6,
                status: OrderStatus::try_from(r.7).map_err(corrupt)?,
                amount_minor: r.8,
                currency: r.9,
                correlation_id: r.10,
            };
            Ok((hold, order))
        })
        .collect()
}

/// Locks hold `hold` (`FOR UPDATE`).
pub async fn lock(tx: &mut Tx<'_>, hold: HoldId) -> Result<Option<HoldRow>, sqlx::Error> {
    lock_where(tx, "id", hold.0).await
}

async fn lock_where(tx: &mut Tx<'_>, column: &'static str, id: Uuid) -> Result<Option<HoldRow>, sqlx::Error> {
    // `column` is one of two literals above, never input.
    let sql = format!(
        "SELECT id, order_id, status, expires_at, {LAPSED} AS lapsed
           FROM holds WHERE {column} = $1 FOR UPDATE"
    );
    sqlx::query_as(&sql).bind(id).fetch_optional(&mut **tx).await
}

/// Moves the locked `hold` to `to` if [`HoldStatus::can_transition_to`] allows it, releasing
/// its seats when `to` gives them back (`expired`, `released`). With [`expire_batch`] the
/// only writer of `holds.status`.
///
/// Errors: [`StoreError::IllegalTransition`] (nothing written), [`StoreError::Corrupt`] if the
/// row changed under the caller's lock.
pub async fn transition(
    tx: &mut Tx<'_>,
    hold: &mut HoldRow,
    to: HoldStatus,
) -> Result<HoldStatus, StoreError> {
    Ok(transition_returning_seats(tx, hold, to).await?.0)
}

/// The seats a hold's move gave back, as [`transition_returning_seats`] released them: every
/// seat row of the hold, ascending id (a hold gives its seats back all at once), with the
/// hold's order. Only that move makes one, and [`crate::tickets::issue`] refuses it for
/// another order, so no seat is ticketed to an order whose hold did not have it.
#[derive(Debug, PartialEq, Eq)]
pub struct ReleasedSeats {
    order: OrderId,
    seats: Vec<Uuid>,
}

impl ReleasedSeats {
    /// The seat ids, ascending.
    pub fn ids(&self) -> &[Uuid] {
        &self.seats
    }

    /// The order whose hold gave them back.
    pub fn order(&self) -> OrderId {
        self.order
    }
}

/// [`transition`], also returning the seats of the hold the move gave back ([`ReleasedSeats`];
/// empty when `to` keeps them): for the ticket worker, whose tickets take the seats a
/// confirmed hold releases, without a read of its own.
pub async fn transition_returning_seats(
    tx: &mut Tx<'_>,
    hold: &mut HoldRow,
    to: HoldStatus,
) -> Result<(HoldStatus, ReleasedSeats), StoreError> {
    let from = hold.status;
    if !from.can_transition_to(to) {
        return Err(crate::IllegalTransition::hold(from, to).into());
    }
    // A move that gives the seats back ($4) releases them in the same statement (by `hold_id`
    // alone, as `release_seats` does).
    let (moved, seats): (i64, Vec<Uuid>) = sqlx::query_as(
        "WITH moved AS (
            UPDATE holds SET status = $2,
                   confirmed_at = CASE WHEN $2 = 'confirmed' THEN clock_timestamp() ELSE confirmed_at END
             WHERE id = $1 AND status = $3 RETURNING id),
         freed AS (
            UPDATE hold_seats SET released_at = COALESCE(released_at, clock_timestamp())
             WHERE $4 AND hold_id IN (SELECT id FROM moved) RETURNING seat_id)
         SELECT (SELECT count(*) FROM moved), ARRAY(SELECT seat_id FROM freed ORDER BY seat_id)",
    )
    .bind(hold.id)
    .bind(to.as_str())
    .bind(from.as_str())
    .bind(to.releases_seats())
    .fetch_one(&mut **tx)
    .await?;
    if moved != 1 {
        return Err(StoreError::Corrupt(format!("hold {} left {from} under its row lock", hold.id)));
    }
    hold.status = to;
    Ok((from, ReleasedSeats { order: OrderId(hold.order_id), seats }))
}

/// Marks the seats of `holds` released. Filters on `hold_id` only (the primary key): with
/// `released_at IS NULL` in the WHERE the planner may pick the partial unique index, whose
/// dead entries make it slow under churn.
async fn release_seats(tx: &mut Tx<'_>, holds: &[Uuid]) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE hold_seats SET released_at = COALESCE(released_at, clock_timestamp()) WHERE hold_id = ANY($1)")
        .bind(holds)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The hold transaction's reclaim of a hold it saw lapsed: locks `hold` and, if it is still
/// `active` and lapsed (checked under the lock), expires it with the lapsed-hold compensation
/// of [`expire_batch`]. Returns whether the hold's seats are free now: `true` when it expired
/// here or had expired meanwhile (the expiry sweep, the saga, or another hold request
/// reclaiming the same multi-seat hold got there first; its seats were released with it);
/// `false` when it was confirmed, extended (a reported authorization's protection) or
/// released meanwhile, or is gone. A released hold is one that was confirmed: its seats went
/// to its tickets, or, when its payment failed after the confirmation, back on sale; the
/// second case refuses seats that are free (409) and the buyer's retry gets them. It needs
/// a confirmation decided just before the lapse and a failed payment within one request.
///
/// Sound only under the caller's seat locks: while they are held no other hold can take the
/// seats an expired hold gave back.
async fn reclaim_if_lapsed(tx: &mut Tx<'_>, hold: HoldId) -> Result<bool, StoreError> {
    let Some(row) = lock(tx, hold).await? else {
        return Ok(false);
    };
    match row.status {
        HoldStatus::Active if row.lapsed => {
            expire_locked(tx, &row).await?;
            Ok(true)
        }
        HoldStatus::Expired => Ok(true),
        HoldStatus::Active | HoldStatus::Confirmed | HoldStatus::Released => Ok(false),
    }
}

/// Expires a hold the caller has locked (the hold transaction's reclaim and the saga's
/// `ExpireHold` compensation). Returns whether its order moved to `expired`.
pub async fn expire_locked(tx: &mut Tx<'_>, hold: &HoldRow) -> Result<bool, StoreError> {
    Ok(!expire_batch(tx, &[(hold.id, hold.order_id)]).await?.is_empty())
}

/// Expires locked, active holds `(hold_id, order_id)` set-wise, in a handful of statements
/// whatever the batch size, and applies the saga's lapsed-hold compensation to their orders:
/// holds → `expired` and their seats released; the orders that
/// [`saga::lapsed_hold_expires_order`] names → `expired`; each payment not yet asked to cancel
/// (and not settled) marked; the facts [`saga::lapsed_hold_facts`] decides into the outbox.
/// Orders are locked in id order. Returns the orders moved to `expired`.
pub async fn expire_batch(tx: &mut Tx<'_>, holds: &[(Uuid, Uuid)]) -> Result<Vec<Uuid>, StoreError> {
    if holds.is_empty() {
        return Ok(vec![]);
    }
    let hold_ids: Vec<Uuid> = holds.iter().map(|h| h.0).collect();
    let order_ids: Vec<Uuid> = holds.iter().map(|h| h.1).collect();
    let sources: Vec<&str> = HoldStatus::sources_of(HoldStatus::Expired).iter().map(|s| s.as_str()).collect();
    let expired = sqlx::query("UPDATE holds SET status = 'expired' WHERE id = ANY($1) AND status = ANY($2)")
        .bind(&hold_ids)
        .bind(&sources)
        .execute(&mut **tx)
        .await?;
    if expired.rows_affected() != hold_ids.len() as u64 {
        return Err(StoreError::Corrupt("a locked hold left active before its expiry".into()));
    }
    release_seats(tx, &hold_ids).await?;
    let orders = crate::orders::lock_many(tx, &order_ids).await?;
    let unpaid: Vec<Uuid> =
        orders.iter().filter(|o| saga::lapsed_hold_expires_order(o.status)).map(|o| o.id).collect();
    let moved = crate::orders::expire_unpaid(tx, &unpaid, saga::reason::HOLD_EXPIRED).await?;
    let cancels: HashMap<Uuid, String> =
        crate::payments::request_cancel_many(&mut **tx, &order_ids).await?.into_iter().collect();
    let correlation: HashMap<Uuid, Uuid> = orders.iter().map(|o| (o.id, o.correlation_id)).collect();
    let mut events = Vec::with_capacity(holds.len() + cancels.len());
    for (hold, order) in holds {
        let order_id = OrderId(*order);
        let mut facts =
            saga::lapsed_hold_facts(order_id, HoldId(*hold), cancels.get(order).cloned()).into_iter();
        let Some(first) = facts.next() else { continue };
        let head = Envelope::new(
            order_id,
            &first,
            correlation.get(order).copied().unwrap_or_else(Uuid::new_v4),
            None,
        );
        let follows: Vec<Envelope> = facts.map(|f| head.follow(&f)).collect();
        events.push(head);
        events.extend(follows);
    }
    outbox::insert_all(tx, &events).await?;
    metrics::counter!("boxoffice_holds_expired_total").increment(holds.len() as u64);
    Ok(moved)
}

/// Expires up to `limit` lapsed active holds in one transaction (`FOR UPDATE SKIP LOCKED`,
/// so several expiry workers never claim the same hold). Returns how many expired and the
/// largest delay between a hold's end ([`HOLD_END`]) and its release, in ms.
///
/// Reads only the active holds whose `expires_at` has passed, a range of `hold_expiry_idx`
/// (`expires_at < now()`, the transaction's start, which the index can take; [`LAPSED`]
/// then judges each by the clock): the active holds of a running onsale that are not due are
/// never read (see "Periodic sweeps" in the crate docs). A hold's end is never before its
/// `expires_at`, so the range holds every lapsed hold.
pub async fn expire_due(pool: &PgPool, limit: i64) -> Result<(usize, i64), StoreError> {
    let mut tx = pool.begin().await?;
    let sql = format!(
        "SELECT id, order_id, (EXTRACT(EPOCH FROM clock_timestamp() - {HOLD_END}) * 1000)::float8
           FROM holds
          WHERE status = 'active' AND expires_at < now() AND {LAPSED}
          ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED"
    );
    let rows: Vec<(Uuid, Uuid, f64)> = sqlx::query_as(&sql).bind(limit).fetch_all(&mut *tx).await?;
    let max_delay = rows.iter().map(|r| r.2 as i64).max().unwrap_or(0);
    let pairs: Vec<(Uuid, Uuid)> = rows.iter().map(|r| (r.0, r.1)).collect();
    expire_batch(&mut tx, &pairs).await?;
    tx.commit().await?;
    Ok((rows.len(), max_delay))
}

/// Rule 3 of [`boxoffice_domain::hold`]: up to `limit` payable holds past their
/// `expires_at`, still waiting for the provider's word (`provider_check_until` ahead), with
/// no authorization reported and no check asked yet, get one: a
/// `PaymentIntentRefreshRequested` (reason [`PROVIDER_CHECK_REASON`]) for the order's
/// PaymentIntent in the outbox and `provider_check_requested_at` set, in one transaction
/// (`FOR UPDATE SKIP LOCKED`). Returns how many checks were asked. Reads the active holds past
/// their `expires_at` only, as [`expire_due`] does, and then, only when it took any, their
/// orders and payments by key: one statement joining them could read every payment ever
/// recorded, as the planner takes "active" and "past its `expires_at`" for independent while
/// nearly every hold past it is no longer active. Every hold with a `provider_check_until`
/// has a payment row: both are written by the statement that records the PaymentIntent.
pub async fn check_lapsing(pool: &PgPool, limit: i64) -> Result<usize, StoreError> {
    let mut tx = pool.begin().await?;
    let due: Vec<Uuid> = sqlx::query_scalar(
        "SELECT order_id FROM holds
          WHERE status = 'active' AND expires_at < now()
            AND provider_check_until > clock_timestamp() AND provider_check_requested_at IS NULL
            AND authorization_reported_at IS NULL
          ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED",
    )
    .bind(limit)
    .fetch_all(&mut *tx)
    .await?;
    if due.is_empty() {
        return Ok(0);
    }
    let rows: Vec<(Uuid, Uuid, String)> = sqlx::query_as(
        "SELECT o.id, o.correlation_id, p.payment_intent_id
           FROM unnest($1::uuid[]) AS k(order_id)
          CROSS JOIN LATERAL (SELECT id, correlation_id FROM orders WHERE id = k.order_id LIMIT 1) o
          CROSS JOIN LATERAL (SELECT payment_intent_id FROM payments WHERE order_id = k.order_id LIMIT 1) p",
    )
    .bind(&due)
    .fetch_all(&mut *tx)
    .await?;
    if rows.is_empty() {
        return Ok(0);
    }
    let orders: Vec<Uuid> = rows.iter().map(|r| r.0).collect();
    sqlx::query("UPDATE holds SET provider_check_requested_at = clock_timestamp() WHERE order_id = ANY($1)")
        .bind(&orders)
        .execute(&mut *tx)
        .await?;
    let events = outbox::refresh_requests(rows, PROVIDER_CHECK_REASON);
    outbox::insert_all(&mut tx, &events).await?;
    tx.commit().await?;
    metrics::counter!("boxoffice_hold_provider_checks_total").increment(events.len() as u64);
    Ok(events.len())
}

/// The `reason` of the re-fetch [`check_lapsing`] asks for.
pub const PROVIDER_CHECK_REASON: &str = "hold_lapsing";

/// Rule 3's answer: the provider's word on `order`'s PaymentIntent is not an authorization,
/// so a wait for it that [`check_lapsing`] started ends now (the hold then lapses by its other
/// ends). A wait no check was asked for is left alone: the buyer may still pay. Returns
/// whether a wait ended.
pub async fn end_provider_check(tx: &mut Tx<'_>, order: OrderId) -> Result<bool, sqlx::Error> {
    let r = sqlx::query(
        "UPDATE holds SET provider_check_until = clock_timestamp()
          WHERE order_id = $1 AND provider_check_requested_at IS NOT NULL
            AND provider_check_until > clock_timestamp()",
    )
    .bind(order.0)
    .execute(&mut **tx)
    .await?;
    Ok(r.rows_affected() == 1)
}

/// Rule 1 of [`boxoffice_domain::hold`]: the order of the hold the caller has locked became
/// payable now (its PaymentIntent was just recorded). The `UPDATE` that records `payable_at`
/// (the first time), ends the wait for it (`payable_by`), and, unless the hold has lapsed,
/// pushes `expires_at` to at least now + the payment window, within `created_at` + the
/// ceiling (and the provider check's end that far past it, when the check is on). `order` is
/// the SQL that names the order (a parameter, or a CTE's row); `window`, `ceiling` and
/// `check` name parameters bound to [`HoldPolicy::payment_window`], [`HoldPolicy::ceiling`]
/// and [`HoldPolicy::provider_check`], in seconds. Run under the hold's row lock, once per
/// order: [`crate::payments::record_created`] runs it in the statement that records the
/// PaymentIntent.
pub(crate) fn open_payment_window(order: &str, window: &str, ceiling: &str, check: &str) -> String {
    // Every SET expression reads the old row, so the wait of rule 3 is computed from the
    // same new expiry expression, not from the updated column.
    let live = format!("status = 'active' AND NOT {LAPSED}");
    let new_expiry = format!(
        "GREATEST(expires_at, LEAST(clock_timestamp() + make_interval(secs => {window}),
                                        created_at + make_interval(secs => {ceiling})))"
    );
    format!(
        "UPDATE holds SET payable_at = COALESCE(payable_at, clock_timestamp()), payable_by = NULL,
                expires_at = CASE WHEN {live} THEN {new_expiry} ELSE expires_at END,
                provider_check_until = CASE WHEN {live} AND {check} > 0
                                            THEN {new_expiry} + make_interval(secs => {check})
                                            ELSE provider_check_until END
          WHERE order_id = {order}"
    )
}

/// Who reports an authorization to [`protect_authorized`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Report {
    /// A webhook claim, not checked yet: the protection runs from the first report no re-fetch
    /// has refuted since, so claims repeated while their re-fetches run extend nothing.
    Claim,
    /// The provider, asked by a re-fetch: the protection runs from now, and ends before the
    /// authorization's capture deadline (`capture_before`, when known).
    Provider {
        /// Stripe's capture deadline for the authorization.
        capture_before: Option<DateTime<Utc>>,
    },
}

/// Rule 2 of [`boxoffice_domain::hold`]: an authorization of `order`'s current PaymentIntent
/// is reported now. If the hold is active and not lapsed, it is protected until `policy.settle`
/// after the report — for a [`Report::Claim`] the first one not refuted since
/// (`authorization_reported_at`, kept), for a [`Report::Provider`] now — or the capture
/// deadline less [`HoldPolicy::CAPTURE_MARGIN`] when that is sooner; a protection is never
/// shortened here. Returns whether the hold is protected. Locks the hold row (callers that
/// also lock the order lock the hold first).
pub async fn protect_authorized(
    tx: &mut Tx<'_>,
    order: OrderId,
    policy: &HoldPolicy,
    report: Report,
) -> Result<bool, sqlx::Error> {
    let margin = chrono::Duration::from_std(HoldPolicy::CAPTURE_MARGIN).unwrap_or_default();
    let (claim, bound) = match report {
        Report::Claim => (true, None),
        Report::Provider { capture_before } => (false, capture_before.map(|c| c - margin)),
    };
    let sql = format!(
        "UPDATE holds SET authorization_reported_at = COALESCE(authorization_reported_at, clock_timestamp()),
                authorized_until = GREATEST(authorized_until,
                    LEAST(CASE WHEN $4 THEN COALESCE(authorization_reported_at, clock_timestamp())
                               ELSE clock_timestamp() END + make_interval(secs => $2),
                          COALESCE($3, 'infinity'::timestamptz)))
          WHERE order_id = $1 AND status = 'active' AND NOT {LAPSED}"
    );
    let r = sqlx::query(&sql)
        .bind(order.0)
        .bind(policy.settle.as_secs_f64())
        .bind(bound)
        .bind(claim)
        .execute(&mut **tx)
        .await?;
    Ok(r.rows_affected() == 1)
}

/// The provider does not confirm a reported authorization of `order` (it says the
/// PaymentIntent is not authorized): the protection of [`protect_authorized`] ends, and the
/// hold lapses by its other ends ([`HOLD_END`]). Returns whether a protection was cleared.
pub async fn clear_protection(tx: &mut Tx<'_>, order: OrderId) -> Result<bool, sqlx::Error> {
    let r = sqlx::query(
        "UPDATE holds SET authorized_until = NULL, authorization_reported_at = NULL
          WHERE order_id = $1 AND status = 'active' AND authorized_until IS NOT NULL",
    )
    .bind(order.0)
    .execute(&mut **tx)
    .await?;
    Ok(r.rows_affected() == 1)
}

/// A confirmed order whose authorization nears Stripe's capture deadline uncaptured (case C09).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct LapsingAuthorization {
    /// The order's hold.
    pub hold_id: Uuid,
    /// The order.
    pub order_id: Uuid,
    /// Its PaymentIntent.
    pub payment_intent_id: String,
}

/// Locks (`FOR UPDATE`, `SKIP LOCKED`, so several workers share the sweep) the holds of up to
/// `limit` confirmed orders whose authorization is uncaptured within `margin_s` seconds of its
/// capture deadline and has no cancel requested, soonest deadline first.
///
/// Two statements, so that no plan can read every hold or payment ever recorded (see
/// "Periodic sweeps" in the crate docs): the candidates from the orders awaiting their capture
/// (`confirming`, through `order_open_idx`), each one's payment read by its key (a `LATERAL`
/// subquery the planner cannot turn into a join); then, only when there are any, their holds
/// by order id. A candidate whose hold another worker has locked is left to it.
pub async fn lock_lapsing_authorizations(
    tx: &mut Tx<'_>,
    margin_s: i64,
    limit: i64,
) -> Result<Vec<LapsingAuthorization>, sqlx::Error> {
    let due: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT o.id, p.payment_intent_id
           FROM orders o
           CROSS JOIN LATERAL (
                SELECT payment_intent_id, capture_before FROM payments
                 WHERE order_id = o.id AND cancel_requested_at IS NULL
                   AND capture_before < now() + make_interval(secs => $1::double precision)
                OFFSET 0) p
          WHERE o.status = 'confirming'
          ORDER BY p.capture_before LIMIT $2",
    )
    .bind(margin_s as f64)
    .bind(limit)
    .fetch_all(&mut **tx)
    .await?;
    if due.is_empty() {
        return Ok(Vec::new());
    }
    let orders: Vec<Uuid> = due.iter().map(|d| d.0).collect();
    let holds: std::collections::HashMap<Uuid, Uuid> = sqlx::query_as(
        "SELECT order_id, id FROM holds WHERE order_id = ANY($1) ORDER BY order_id FOR UPDATE SKIP LOCKED",
    )
    .bind(&orders)
    .fetch_all(&mut **tx)
    .await?
    .into_iter()
    .collect();
    Ok(due
        .into_iter()
        .filter_map(|(order_id, payment_intent_id)| {
            holds.get(&order_id).map(|hold_id| LapsingAuthorization {
                hold_id: *hold_id,
                order_id,
                payment_intent_id,
            })
        })
        .collect())
}
