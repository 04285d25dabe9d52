//! Live order status for buyers: `GET /orders/{order_id}/events` as Server-Sent Events
//! (design §16), so a buyer waiting for the client secret, the confirmation or the tickets
//! is told when the order changes instead of asking every second.
//!
//! **Push, not polling.** The relay, in the statement that marks a batch published, sends
//! `NOTIFY boxoffice_orders` with the batch's order ids ([`boxoffice_store::outbox::mark_published`]):
//! every change of an order commits a fact in the same transaction (invariant 5), so a
//! published fact means the ledger has changed for that order. One notifying transaction per
//! relay batch, not per order: PostgreSQL serializes the commits of notifying transactions,
//! and a trigger per change would put every purchase transaction in that queue. Each API
//! process keeps ONE `LISTEN` connection ([`listen`]), which marks the watched orders named.
//!
//! **One read for every woken stream.** Each API process has one view reader ([`read_views`]):
//! it reads every order marked since its last read (first marked first, at most
//! [`MAX_VIEWS_PER_READ`] a read), for every user with a stream of it, in one statement
//! ([`boxoffice_store::orders::views`], the query and rules of `GET /orders/{id}`: a user gets
//! only an order that is theirs, the client secret only while payment is pending), and hands
//! each view to that user's streams of that order, which send it when it differs from what
//! they sent last; a stream of someone else's order is handed "no such order" and answered
//! 404, as by
//! `GET /orders/{id}`. A new stream's first view, and every re-read, go through the same
//! reader. Its reads run one after another, each statement starting after the one before it
//! ended, so a stream never sends an older view after a newer one. Each row is decoded on its
//! own: a row this build cannot read (a status it does not know, a missing value) fails alone
//! (its streams are handed a failure) and the others of the read get their views. A statement
//! that fails as a whole (a timeout, a lost connection) marks its orders again, behind those
//! already marked, and the reader pauses (200 ms doubling to 5 s); the reads after it are
//! halved, down to one order, and doubled back with each read that succeeds, up to
//! [`MAX_VIEWS_PER_READ`], so a read too large for the statement timeout gets smaller. A
//! stream waiting for its first view is answered 503 `unavailable` on a failure, or after
//! [`FIRST_VIEW_WAIT`]; open streams stay open. If the reader ends (shutdown, or a fault), the
//! process's streams end (the client reconnects, `retry:`), new ones are answered 503, an
//! end before shutdown is logged as an error, and `/readyz` answers 503.
//!
//! **Bounds.** Every stream:
//! - belongs to the order's owner (else 404, like `GET /orders/{id}`), and passes the purchase
//!   route's rate buckets;
//! - counts against [`StreamSettings::max_per_user`] streams per user,
//!   [`StreamSettings::max_per_ip`] per client address and [`StreamSettings::max_streams`] per
//!   process (429 `too_many_streams` with `Retry-After`). A stream holds a connection for its
//!   whole life while the per-client in-flight bound counts a request only until its headers,
//!   so the configuration keeps `max_streams` at most half of `http_max_connections`: streams
//!   can never take the slots of holds and webhooks;
//! - sends a comment heartbeat every [`StreamSettings::heartbeat`], re-reads the order every
//!   [`StreamSettings::reread`] as a net under a lost notification (a `LISTEN` connection that
//!   dropped re-reads every stream once when it is back), and ends after
//!   [`StreamSettings::max_lifetime`] (the client reconnects: `retry:` is sent);
//! - ends cleanly (`event: end`) once the order is final (`ticketed`, `expired`, `failed`,
//!   `canceled`, `refunded`).
//!
//! One change may commit no fact: the saga's `held → payment_required` when it applies
//! `PaymentIntentCreated` from the bus. In a process that runs the saga beside the payment
//! worker, that step rides in the transaction that records the PaymentIntent
//! (`boxoffice_bus::follow`) and the stream sees `payment_required` at once; otherwise the
//! stream was already woken by that fact, whose transaction wrote the PaymentIntent and its
//! client secret, so the buyer can pay from the `held` event, and the status itself shows
//! `payment_required` at the next change or re-read.
//!
//! Metrics: `boxoffice_order_streams` (open), `boxoffice_order_stream_reads_total` (ledger
//! reads made for streams, one statement each), `boxoffice_order_stream_views_total` ((order,
//! user) pairs read by them), `boxoffice_order_stream_events_total`,
//! `boxoffice_order_stream_refused_total{reason}` (`user`, `ip`, `process`, and for 503:
//! `stopped`, `read_failed`, `read_timeout`), `boxoffice_order_notifications_total`.

use crate::auth::{IdPath, User};
use crate::problem::Problem;
use crate::state::AppState;
use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use boxoffice_domain::{OrderId, UserId};
use boxoffice_store::orders::{self, OrderView};
use futures::Stream;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The channel the relay notifies with the order ids of each published batch.
pub const CHANNEL: &str = boxoffice_store::outbox::ORDER_CHANNEL;

/// Stream bounds.
#[derive(Debug, Clone)]
pub struct StreamSettings {
    /// Open streams per user per process.
    pub max_per_user: usize,
    /// Open streams per client address per process (IPv6 by /64, behind the trusted proxy
    /// hops): many accounts behind one address cannot hold every connection open.
    pub max_per_ip: usize,
    /// Open streams per process.
    pub max_streams: usize,
    /// Comment heartbeat interval.
    pub heartbeat: Duration,
    /// Re-read interval without a notification.
    pub reread: Duration,
    /// A stream ends after this long; the client reconnects.
    pub max_lifetime: Duration,
}

impl Default for StreamSettings {
    fn default() -> Self {
        Self {
            max_per_user: 4,
            max_per_ip: 16,
            max_streams: 2_048,
            heartbeat: Duration::from_secs(15),
            reread: Duration::from_secs(30),
            max_lifetime: Duration::from_secs(15 * 60),
        }
    }
}

/// Orders one view read takes at most; more marked orders wait for the next read.
pub const MAX_VIEWS_PER_READ: usize = 512;

/// How long a new stream waits for its first view before it is answered 503.
pub const FIRST_VIEW_WAIT: Duration = Duration::from_secs(15);

/// What the view reader last handed to the streams of one user watching one order.
#[derive(Debug, Clone)]
pub enum ViewRead {
    /// Nothing yet since this stream subscribed.
    Pending,
    /// The order as its owner sees it, or `None`: no such order for this user.
    Order(Option<Arc<OrderView>>),
    /// The read failed (the database, or a row this build cannot read); the stream waits
    /// for the next view, a new stream is answered 503.
    Failed,
}

/// The streams of one process: who is open, the views handed to each (order, user) watched,
/// and the orders marked for the view reader's next read.
#[derive(Default)]
pub struct OrderStreams {
    settings: StreamSettings,
    inner: Mutex<Inner>,
    wake: tokio::sync::Notify,
    reads: AtomicU64,
    reader_started: AtomicBool,
}

#[derive(Default)]
struct Inner {
    per_user: HashMap<Uuid, usize>,
    per_ip: HashMap<String, usize>,
    open: usize,
    /// Per watched order, per user watching it: the channel of that user's streams and how
    /// many there are. A view goes only to the channel of the user it belongs to.
    watched: HashMap<Uuid, HashMap<Uuid, (watch::Sender<ViewRead>, usize)>>,
    /// Watched orders to read, first marked first; `queued` holds the same ids.
    queue: VecDeque<Uuid>,
    queued: HashSet<Uuid>,
    /// The view reader has stopped: every channel was dropped (its streams end) and new
    /// streams are refused.
    reader_stopped: bool,
}

/// Counts only: the views it holds belong to buyers.
impl std::fmt::Debug for OrderStreams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("OrderStreams");
        d.field("settings", &self.settings).field("reads", &self.reads());
        // Never waits for the lock: a caller may hold it.
        if let Ok(g) = self.inner.try_lock() {
            d.field("open", &g.open)
                .field("watched_orders", &g.watched.len())
                .field("marked", &g.queued.len())
                .field("reader_stopped", &g.reader_stopped);
        }
        d.finish_non_exhaustive()
    }
}

impl Inner {
    /// Marks `order` for the next read, if it is watched and not marked yet.
    fn mark(&mut self, order: Uuid) -> bool {
        if !self.watched.contains_key(&order) {
            return false;
        }
        if self.queued.insert(order) {
            self.queue.push_back(order);
        }
        // Ids of streams that closed while marked stay in `queue` until taken; while the
        // reader is held up they are dropped here, so the queue stays as long as the marks.
        if self.queue.len() > 2 * self.queued.len() + 1_024 {
            let queued = &self.queued;
            self.queue.retain(|id| queued.contains(id));
        }
        true
    }
}

/// One admitted stream: released (and its order unwatched) when dropped.
pub struct Admitted {
    hub: Arc<OrderStreams>,
    user: Uuid,
    ip: String,
    order: Uuid,
    /// The views the reader hands to this user's streams of this order.
    views: watch::Receiver<ViewRead>,
}

impl std::fmt::Debug for Admitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admitted")
            .field("user", &self.user)
            .field("order", &self.order)
            .finish_non_exhaustive()
    }
}

impl Admitted {
    /// The next view the reader hands over for this stream.
    ///
    /// # Errors
    /// The view reader has stopped (the process is stopping, or the reader failed): the
    /// stream must end.
    pub async fn next_view(&mut self) -> Result<ViewRead, watch::error::RecvError> {
        self.views.changed().await?;
        Ok(self.views.borrow_and_update().clone())
    }

    /// Whether the reader has handed over a view this stream has not taken yet.
    pub fn has_new_view(&self) -> bool {
        self.views.has_changed().unwrap_or(false)
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut g = self.hub.lock();
        g.open -= 1;
        if let Some(n) = g.per_user.get_mut(&self.user) {
            *n -= 1;
            if *n == 0 {
                g.per_user.remove(&self.user);
            }
        }
        if let Some(n) = g.per_ip.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                g.per_ip.remove(&self.ip);
            }
        }
        if let Some(users) = g.watched.get_mut(&self.order) {
            if let Some((_, n)) = users.get_mut(&self.user) {
                *n -= 1;
                if *n == 0 {
                    users.remove(&self.user);
                }
            }
            if users.is_empty() {
                g.watched.remove(&self.order);
                g.queued.remove(&self.order);
            }
        }
        metrics::gauge!("boxoffice_order_streams").set(g.open as f64);
    }
}

/// Why a stream was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The user has `max_per_user` streams open.
    User,
    /// The client address has `max_per_ip` streams open.
    Ip,
    /// The process has `max_streams` open.
    Process,
    /// The view reader has stopped (503).
    Stopped,
}

impl OrderStreams {
    /// A hub with `settings`. Its streams are answered by [`read_views`], which the process
    /// must run beside it.
    pub fn new(settings: StreamSettings) -> Arc<Self> {
        Arc::new(Self { settings, ..Self::default() })
    }

    /// The bounds.
    pub fn settings(&self) -> &StreamSettings {
        &self.settings
    }

    /// The state; a panic elsewhere while it was held leaves counts that are still usable.
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Admits a stream of `user` from client address `ip` (a bucket key) watching `order`,
    /// and marks the order for the reader's next read (the stream's first view), or says which
    /// bound refuses it.
    pub fn admit(self: &Arc<Self>, user: Uuid, ip: String, order: Uuid) -> Result<Admitted, Refused> {
        let mut g = self.lock();
        if g.reader_stopped {
            return Err(Refused::Stopped);
        }
        if g.open >= self.settings.max_streams {
            return Err(Refused::Process);
        }
        if g.per_user.get(&user).copied().unwrap_or(0) >= self.settings.max_per_user {
            return Err(Refused::User);
        }
        if g.per_ip.get(&ip).copied().unwrap_or(0) >= self.settings.max_per_ip {
            return Err(Refused::Ip);
        }
        g.open += 1;
        *g.per_user.entry(user).or_default() += 1;
        *g.per_ip.entry(ip.clone()).or_default() += 1;
        let entry = g
            .watched
            .entry(order)
            .or_default()
            .entry(user)
            .or_insert_with(|| (watch::channel(ViewRead::Pending).0, 0));
        entry.1 += 1;
        let views = entry.0.subscribe();
        g.mark(order);
        metrics::gauge!("boxoffice_order_streams").set(g.open as f64);
        drop(g);
        self.wake.notify_one();
        Ok(Admitted { hub: self.clone(), user, ip, order, views })
    }

    /// Marks the watched orders among `orders` for the reader's next read; returns how many
    /// were watched.
    pub fn notify<'a>(&self, orders: impl IntoIterator<Item = &'a str>) -> usize {
        let mut g = self.lock();
        let woken = orders
            .into_iter()
            .filter_map(|id| id.trim().parse::<Uuid>().ok())
            .filter(|id| g.mark(*id))
            .count();
        drop(g);
        if woken > 0 {
            self.wake.notify_one();
        }
        woken
    }

    /// Marks every watched order (after the `LISTEN` connection was lost and came back).
    pub fn notify_all(&self) {
        let mut g = self.lock();
        let all: Vec<Uuid> = g.watched.keys().copied().collect();
        for id in all {
            g.mark(id);
        }
        drop(g);
        self.wake.notify_one();
    }

    /// Marks `order` for a re-read, if it is watched (a stream's net under a lost
    /// notification).
    pub fn reread(&self, order: Uuid) {
        if self.lock().mark(order) {
            self.wake.notify_one();
        }
    }

    /// Whether the view reader has stopped: the process's streams are refused (`/readyz`
    /// answers 503 while it is so).
    pub fn reader_stopped(&self) -> bool {
        self.lock().reader_stopped
    }

    /// Open streams.
    pub fn open(&self) -> usize {
        self.lock().open
    }

    /// View reads made since the process started (statements; each reads the orders marked
    /// before it, first marked first, up to [`MAX_VIEWS_PER_READ`]).
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    /// Takes up to `limit` marked orders, first marked first, with every user watching each;
    /// returns the pairs and how many orders they are of.
    fn take_marked(&self, limit: usize) -> (Vec<(OrderId, UserId)>, usize) {
        let mut g = self.lock();
        let mut pairs = Vec::new();
        let mut taken = 0;
        while taken < limit {
            let Some(order) = g.queue.pop_front() else { break };
            // Unwatched since it was marked.
            if !g.queued.remove(&order) {
                continue;
            }
            taken += 1;
            if let Some(users) = g.watched.get(&order) {
                pairs.extend(users.keys().map(|u| (OrderId(order), UserId(*u))));
            }
        }
        (pairs, taken)
    }

    /// Hands `read` to the streams of `user` watching `order`, if there are any.
    fn hand_over(g: &Inner, order: OrderId, user: UserId, read: ViewRead) {
        if let Some((tx, _)) = g.watched.get(&order.0).and_then(|users| users.get(&user.0)) {
            tx.send_replace(read);
        }
    }
}

/// Marks the hub's reader stopped when [`read_views`] ends, however it ends: every channel is
/// dropped, so open streams end (their clients reconnect, `retry:`) and waiting ones are
/// answered 503, instead of waiting for views that will not come.
struct ReaderStopped(Arc<OrderStreams>, CancellationToken);

impl Drop for ReaderStopped {
    fn drop(&mut self) {
        if !self.1.is_cancelled() {
            tracing::error!("order streams: the view reader ended before shutdown; streams are refused until the process restarts");
        }
        let mut g = self.0.lock();
        g.reader_stopped = true;
        g.watched.clear();
        g.queue.clear();
        g.queued.clear();
    }
}

/// The view reader of one process, until `shutdown`: reads the orders marked since its last
/// read, with every user watching each, in one statement ([`orders::views`]: a user gets the
/// view only of an order that is theirs) and hands each view to that user's streams of that
/// order. One read at a time, so the views of an order only move forward; a hub has one reader
/// (a second call returns at once). A row this build cannot read fails alone; a failed
/// statement marks its orders again (behind those already marked), waits (200 ms, doubling to
/// 5 s) and halves the size of the reads that follow, down to one order; each read that
/// succeeds doubles it back, up to [`MAX_VIEWS_PER_READ`]. When it ends, the hub's streams end
/// and new ones are refused; an end before `shutdown` is logged as an error.
pub async fn read_views(pool: sqlx::PgPool, hub: Arc<OrderStreams>, shutdown: CancellationToken) {
    if hub.reader_started.swap(true, Ordering::SeqCst) {
        tracing::error!("order streams: a view reader already runs for this hub; not starting another");
        return;
    }
    let _stopped = ReaderStopped(hub.clone(), shutdown.clone());
    let mut backoff = Duration::from_millis(200);
    // Orders a read takes at most: halved by a failed statement, doubled by a good one.
    let mut limit = MAX_VIEWS_PER_READ;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = hub.wake.notified() => {}
        }
        loop {
            let (pairs, orders) = hub.take_marked(limit);
            if orders == 0 {
                break;
            }
            // Orders whose streams all closed since they were marked (closing a stream unmarks
            // its order, so this is not expected): nothing to read, take the next ones.
            if pairs.is_empty() {
                continue;
            }
            let read = async {
                // An injected failure stands for a failed statement, before any is sent.
                boxoffice_faults::check("order_stream.read")?;
                hub.reads.fetch_add(1, Ordering::Relaxed);
                metrics::counter!("boxoffice_order_stream_reads_total").increment(1);
                metrics::counter!("boxoffice_order_stream_views_total").increment(pairs.len() as u64);
                Ok::<_, ReadError>(orders::views(&pool, &pairs).await?)
            };
            let read = tokio::select! {
                _ = shutdown.cancelled() => return,
                r = read => r,
            };
            match read {
                Ok(rows) => {
                    backoff = Duration::from_millis(200);
                    limit = (limit * 2).min(MAX_VIEWS_PER_READ);
                    let mut found: HashMap<(Uuid, Uuid), Result<OrderView, boxoffice_store::StoreError>> =
                        rows.into_iter().map(|(o, u, v)| ((o.0, u.0), v)).collect();
                    let g = hub.lock();
                    for (order, user) in &pairs {
                        let read = match found.remove(&(order.0, user.0)) {
                            None => ViewRead::Order(None),
                            Some(Ok(v)) => ViewRead::Order(Some(Arc::new(v))),
                            Some(Err(e)) => {
                                tracing::warn!(order.id = %order.0, error = %e, "order streams: this order cannot be read");
                                ViewRead::Failed
                            }
                        };
                        OrderStreams::hand_over(&g, *order, *user, read);
                    }
                }
                Err(e) => {
                    limit = (orders / 2).max(1);
                    tracing::warn!(error = %e, orders, next_read_at_most = limit,
                        "order streams: reading the orders failed; trying again");
                    {
                        let mut g = hub.lock();
                        for (order, user) in &pairs {
                            OrderStreams::hand_over(&g, *order, *user, ViewRead::Failed);
                            g.mark(order.0);
                        }
                    }
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }
}

/// Why a view read failed as a whole.
#[derive(Debug, thiserror::Error)]
enum ReadError {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Injected(#[from] boxoffice_faults::Injected),
}

/// Listens on [`CHANNEL`] with one dedicated connection until `shutdown` and marks the watched
/// orders named for the view reader. Reconnects on its own (sqlx's `PgListener`); after a lost
/// connection every stream is woken once, since notifications sent meanwhile are gone.
pub async fn listen(pool: sqlx::PgPool, hub: Arc<OrderStreams>, shutdown: CancellationToken) {
    let mut backoff = Duration::from_millis(200);
    while !shutdown.is_cancelled() {
        let mut listener = match sqlx::postgres::PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "order notifications: cannot connect; streams fall back to re-reads");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        if let Err(e) = listener.listen(CHANNEL).await {
            tracing::warn!(error = %e, "order notifications: LISTEN failed");
            continue;
        }
        backoff = Duration::from_millis(200);
        hub.notify_all();
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => return,
                n = listener.try_recv() => n,
            };
            match next {
                Ok(Some(n)) => {
                    metrics::counter!("boxoffice_order_notifications_total").increment(1);
                    hub.notify(n.payload().split(','));
                }
                // The connection was lost and sqlx reconnected: what was sent meanwhile is lost.
                Ok(None) => hub.notify_all(),
                Err(e) => {
                    tracing::warn!(error = %e, "order notifications: connection failed");
                    break;
                }
            }
        }
    }
}

/// `GET /orders/{order_id}/events` → `text/event-stream`: `event: order` with the order as
/// `GET /orders/{id}` returns it, now and on every change; `event: end` at a final state.
#[utoipa::path(get, path = "/orders/{order_id}/events", tag = "purchase",
    params(("order_id" = Uuid, Path, description = "Order id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Server-Sent Events: `event: order` (data: the order, as `GET /orders/{id}`) now and at every change, a comment heartbeat every 15 s, `event: end` once the order is final; the stream also ends after 15 min (`retry:` is sent, reconnect)", content_type = "text/event-stream", body = String),
        (status = 400, description = "`invalid_path`: the order id is not a UUID", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 401, description = "`unauthenticated`: no or invalid bearer token", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 404, description = "`not_found`: no such order for this user", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 429, description = "`too_many_streams` (this user or this client address has as many streams open as allowed, or the process is full), `rate_limited` or `too_many_in_flight`; `Retry-After` in seconds", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 503, description = "`unavailable`: the order could not be read (the database failed or did not answer within 15 s, or this build cannot read the order), or this process's streams have stopped; `Retry-After`", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
    ))]
pub async fn order_events(
    State(st): State<AppState>,
    peer: Option<axum::Extension<axum::extract::ConnectInfo<std::net::SocketAddr>>>,
    headers: axum::http::HeaderMap,
    user: User,
    IdPath(order): IdPath<Uuid>,
) -> Result<Response, Problem> {
    let ip = crate::edge::client_ip(peer.map(|p| (p.0).0.ip()), &headers, st.settings.trusted_proxy_hops)
        .map(crate::edge::bucket_key)
        .unwrap_or_default();
    let mut admitted = st.order_streams.admit(user.0 .0, ip, order).map_err(|r| {
        let settings = st.order_streams.settings();
        let (scope, max) = match r {
            Refused::User => ("user", settings.max_per_user),
            Refused::Ip => ("ip", settings.max_per_ip),
            Refused::Process => ("process", settings.max_streams),
            Refused::Stopped => return Problem::stream_unavailable("stopped"),
        };
        metrics::counter!("boxoffice_order_stream_refused_total", "reason" => scope).increment(1);
        Problem::too_many_streams(scope, max)
    })?;
    let wait_until = tokio::time::Instant::now() + FIRST_VIEW_WAIT;
    let first = loop {
        match tokio::time::timeout_at(wait_until, admitted.next_view()).await {
            Ok(Ok(ViewRead::Order(Some(v)))) => break v,
            Ok(Ok(ViewRead::Order(None))) => return Err(Problem::not_found("order")),
            Ok(Ok(ViewRead::Pending)) => continue,
            Ok(Ok(ViewRead::Failed)) => return Err(Problem::stream_unavailable("read_failed")),
            Ok(Err(_)) => return Err(Problem::stream_unavailable("stopped")),
            Err(_) => return Err(Problem::stream_unavailable("read_timeout")),
        }
    };
    let settings = st.order_streams.settings().clone();
    let stream = events(admitted, first, settings.clone());
    let mut resp = Sse::new(stream).keep_alive(KeepAlive::new().interval(settings.heartbeat)).into_response();
    resp.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    // Proxies (nginx) must not buffer the stream.
    resp.headers_mut().insert("x-accel-buffering", HeaderValue::from_static("no"));
    Ok(resp)
}

/// Where a stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Sending changes.
    Live,
    /// The order is final and its state sent: `event: end` is next.
    End,
    /// Closed.
    Done,
}

struct Streaming {
    admitted: Admitted,
    last: Option<String>,
    pending: Option<Arc<OrderView>>,
    deadline: tokio::time::Instant,
    settings: StreamSettings,
    phase: Phase,
}

fn events(
    admitted: Admitted,
    first: Arc<OrderView>,
    settings: StreamSettings,
) -> impl Stream<Item = Result<Event, std::convert::Infallible>> {
    let deadline = tokio::time::Instant::now() + settings.max_lifetime;
    let state =
        Streaming { admitted, last: None, pending: Some(first), deadline, settings, phase: Phase::Live };
    futures::stream::unfold(state, |mut s| async move {
        loop {
            match s.phase {
                Phase::Done => return None,
                Phase::End => {
                    s.phase = Phase::Done;
                    return Some((Ok(Event::default().event("end").data("final")), s));
                }
                Phase::Live => {}
            }
            if let Some(view) = s.pending.take() {
                let json = serde_json::to_string(&*view).expect("order views serialize");
                if view.status.is_final() {
                    s.phase = Phase::End;
                }
                if s.last.as_deref() != Some(json.as_str()) {
                    metrics::counter!("boxoffice_order_stream_events_total").increment(1);
                    // No `id:`: a reconnecting client gets the order as it is now, so there is
                    // nothing to resume from.
                    let ev = Event::default().event("order").retry(Duration::from_secs(2)).data(json.clone());
                    s.last = Some(json);
                    return Some((Ok(ev), s));
                }
                continue;
            }
            tokio::select! {
                read = s.admitted.next_view() => match read {
                    Ok(ViewRead::Order(Some(v))) => s.pending = Some(v),
                    // Gone: the stream ends as `GET /orders/{id}` would answer 404.
                    Ok(ViewRead::Order(None)) => return None,
                    // The reader tries again; the stream waits for its next view.
                    Ok(ViewRead::Pending | ViewRead::Failed) => {}
                    // The reader stopped: the client reconnects (`retry:`).
                    Err(_) => return None,
                },
                _ = tokio::time::sleep(s.settings.reread) => s.admitted.hub.reread(s.admitted.order),
                _ = tokio::time::sleep_until(s.deadline) => return None,
            }
        }
    })
}
