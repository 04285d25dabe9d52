//! The simulated buyers of the onsale and the chaos drill: N concurrent tokio tasks that
//! walk the purchase path over HTTP only (admission → seat map → hold → pay at the Stripe
//! simulator like Stripe.js → poll the order to a final state), and the statistics they
//! produce. Every request goes through [`crate::client`].
//!
//! Owns: one shared reqwest client, a semaphore capping in-flight requests, ONE shared seat
//! map refreshed single-flight at most every ~1 s (plus the seats this generator saw taken
//! since, greyed out like a real client would), and the counters/histograms of the report.
//!
//! Retries follow the API's contract: transport errors, 5xx and 429 retry the *same* request
//! (same Idempotency-Key and body) with bounded jittered backoff; a 409 `seat_unavailable`
//! leads to a new pick with a new key. Nothing here panics: every unexpected answer is
//! counted in `http_errors` and ends or continues the buyer's journey.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use reqwest::{RequestBuilder, StatusCode};
use serde::Serialize;
use tokio::sync::Semaphore;
use uuid::Uuid;

use crate::client::{self, Admission, BuyerClient, HoldReceipt, OrderView, Problem};
use crate::queue::{self, QueuePacing, QueueStats};
use crate::seatpick::{SeatMap, SeatMapBody};
use crate::stats::{self, Percentiles};

/// How often the shared seat map is refreshed at most (the server caches it for 1 s).
const MAP_REFRESH: Duration = Duration::from_millis(1_000);
/// Attempts per request (first try included) on transport errors, 5xx, 429 or a busy key.
const MAX_TRIES: u32 = 6;
/// Per-request timeout of the shared HTTP client.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// An order stream silent this long (no event, no heartbeat: the server's is 15 s) is broken.
const STREAM_READ_TIMEOUT: Duration = Duration::from_secs(40);

/// Streams a buyer opens for one wait before it falls back to polling.
const STREAM_TRIES: usize = 3;

/// What `drive` needs to know. Times in ms; shares in `0.0..=1.0`.
#[derive(Clone)]
pub struct BuyerConfig {
    /// boxoffice API base URL without trailing slash, e.g. `http://127.0.0.1:8080`.
    pub api_url: String,
    /// Stripe simulator base URL, e.g. `http://127.0.0.1:12111`.
    pub stripe_api_base: String,
    /// Publishable key (`pk_test_…`) used to confirm intents like Stripe.js does.
    pub stripe_publishable_key: String,
    /// The event on sale.
    pub event_id: Uuid,
    /// Number of buyers (default 20 000).
    pub buyers: usize,
    /// Cap on concurrent HTTP requests from the generator (default 256).
    pub max_in_flight: usize,
    /// Share of buyers paying with `pm_card_chargeDeclined`, then abandoning (default 0.05).
    pub decline_share: f64,
    /// Share of buyers that never pay, so their hold expires (default 0.05).
    pub abandon_share: f64,
    /// Each buyer wants 1..=max_seats adjacent seats, uniformly (default 4, at most 8).
    pub max_seats: usize,
    /// Different seat picks a buyer tries after 409 `seat_unavailable` (default 5).
    pub hold_attempts: usize,
    /// Order polling interval in ms (default 250), for [`OrderStatusMode::Poll`] and for a
    /// buyer whose stream failed.
    pub poll_interval_ms: u64,
    /// How buyers follow their order (default [`OrderStatusMode::Stream`]).
    pub order_status: OrderStatusMode,
    /// Per-buyer deadline in ms, from the hold, to see a final order state (default 180 000).
    pub final_timeout_ms: u64,
    /// Seed of the buyers' random choices (seat counts, picks, pay/decline/abandon).
    pub seed: u64,
    /// Mints a bearer JWT for a user id.
    pub user_token: Arc<dyn Fn(Uuid) -> String + Send + Sync>,
    /// Show a progress bar on stderr (hidden when stderr is not a terminal).
    pub progress: bool,
    /// Buyers arriving per second (open loop: buyer `i` starts at `i / rate` s whatever the
    /// server's speed); 0 starts every buyer at once.
    pub arrival_rate: f64,
    /// How buyers get their admission token.
    pub admission: AdmissionRoute,
    /// A paying buyer confirms a uniformly random 0..=this many ms after first seeing the
    /// client secret (typing card details; 0 = at once).
    pub pay_within_ms: u64,
    /// When set, every successful hold appends (when its 202 arrived, its latency as in
    /// [`BuyerStats::hold_latency_ms`]) here, for latencies over time windows.
    pub hold_timeline: Option<HoldTimeline>,
}

/// How a buyer follows its order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OrderStatusMode {
    /// `GET /orders/{id}/events` (Server-Sent Events): the server says when it changes.
    #[default]
    Stream,
    /// `GET /orders/{id}` every `poll_interval_ms`, backing off.
    Poll,
}

/// Successful holds as they complete: (when the 202 arrived, hold latency).
pub type HoldTimeline = Arc<Mutex<Vec<(Instant, Duration)>>>;

/// How a buyer gets its admission token.
#[derive(Debug, Clone)]
pub enum AdmissionRoute {
    /// `POST /events/{id}/admission` (deployments with `admission_direct`): at once.
    Direct,
    /// Through the waiting room: join, poll, admitted at the release rate ([`crate::queue`]).
    Queue(QueuePacing),
}

impl BuyerConfig {
    /// A config with the documented defaults and seed 0.
    pub fn new(
        api_url: impl Into<String>,
        stripe_api_base: impl Into<String>,
        stripe_publishable_key: impl Into<String>,
        event_id: Uuid,
        user_token: Arc<dyn Fn(Uuid) -> String + Send + Sync>,
    ) -> Self {
        Self {
            api_url: api_url.into(),
            stripe_api_base: stripe_api_base.into(),
            stripe_publishable_key: stripe_publishable_key.into(),
            event_id,
            buyers: 20_000,
            max_in_flight: 256,
            decline_share: 0.05,
            abandon_share: 0.05,
            max_seats: 4,
            hold_attempts: 5,
            poll_interval_ms: 250,
            order_status: OrderStatusMode::Stream,
            final_timeout_ms: 180_000,
            seed: 0,
            user_token,
            progress: false,
            arrival_rate: 0.0,
            admission: AdmissionRoute::Direct,
            pay_within_ms: 0,
            hold_timeline: None,
        }
    }

    fn validate(&self) -> anyhow::Result<()> {
        let share = |s: f64| (0.0..=1.0).contains(&s);
        anyhow::ensure!(
            share(self.decline_share)
                && share(self.abandon_share)
                && self.decline_share + self.abandon_share <= 1.0,
            "decline_share and abandon_share must be in 0..=1 and sum to at most 1"
        );
        anyhow::ensure!((1..=8).contains(&self.max_seats), "max_seats must be 1..=8");
        anyhow::ensure!(self.max_in_flight >= 1, "max_in_flight must be at least 1");
        anyhow::ensure!(self.hold_attempts >= 1, "hold_attempts must be at least 1");
        anyhow::ensure!(
            self.arrival_rate >= 0.0 && self.arrival_rate.is_finite(),
            "arrival_rate must be >= 0"
        );
        Ok(())
    }
}

/// Counts and latencies aggregated over all buyers (counts are events, not unique buyers,
/// except where noted).
#[derive(Debug, Clone, Default, Serialize)]
pub struct BuyerStats {
    /// Buyers that finished their journey (all of them once `drive` returns).
    pub buyers: u64,
    /// Hold requests made with a new Idempotency-Key (same-key retries excluded).
    pub hold_attempts: u64,
    /// Successful holds (202).
    pub holds: u64,
    /// 409 `seat_unavailable` answers.
    pub conflicts_409: u64,
    /// Buyers who found no free seat on the map.
    pub sold_out: u64,
    /// Buyers who gave up after `hold_attempts` conflicts in a row.
    pub gave_up: u64,
    /// Orders seen in `confirming`, `paid` or `ticketed`.
    pub authorized: u64,
    /// Card declines (402 `card_error`) at the simulator.
    pub declined: u64,
    /// Buyers who held seats and chose never to pay.
    pub abandoned: u64,
    /// Orders that ended `expired`.
    pub expired: u64,
    /// Orders that ended `ticketed`.
    pub ticketed_orders: u64,
    /// Orders that ended `failed`.
    pub failed_orders: u64,
    /// Orders that ended `canceled`.
    pub canceled_orders: u64,
    /// Orders that ended `refunded`.
    pub refunded_orders: u64,
    /// Orders that ended in a state this generator does not know.
    pub other_final: u64,
    /// Orders with no final state before `final_timeout_ms`.
    pub timed_out: u64,
    /// 5xx answers, transport errors and unexpected statuses (each occurrence).
    pub http_errors: u64,
    /// `GET /orders/{id}` requests made (polling, or after a stream failed).
    pub status_polls: u64,
    /// `GET /orders/{id}/events` streams opened (reconnections included).
    pub status_streams: u64,
    /// `event: order` messages received on them.
    pub status_stream_events: u64,
    /// Streams refused or broken, after which the buyer polled.
    pub status_stream_fallbacks: u64,
    /// The `GET /orders/{id}` requests a buyer polling every `poll_interval_ms` (with the
    /// same backoff) would have made over the time the streams covered.
    pub status_polls_replaced: u64,
    /// Hold latency: first send (after the in-flight permit) to 202, same-key retries included.
    pub hold_latency_ms: Percentiles,
    /// 202 received → `ticketed` observed (resolution: the polling interval).
    pub hold_to_ticket_ms: Percentiles,
    /// Wall time of the whole run, ms.
    pub elapsed_ms: u64,
    /// Successful holds per second over the hold phase (start → last successful hold).
    pub holds_per_s: f64,
    /// The waiting-room phase, when buyers came through it.
    pub queue: Option<QueueStats>,
}

/// Defines the live counters, one `AtomicU64` per plain count of [`BuyerStats`], and their
/// copy into it.
macro_rules! counters {
    ($($name:ident),* $(,)?) => {
        /// Live counters, shared by all buyer tasks.
        #[derive(Default)]
        struct Counters {
            $($name: AtomicU64,)*
            /// ms since start of the latest successful hold.
            last_hold_ms: AtomicU64,
        }

        impl Counters {
            fn copy_into(&self, stats: &mut BuyerStats) {
                $(stats.$name = get(&self.$name);)*
            }
        }
    };
}

counters!(
    buyers,
    hold_attempts,
    holds,
    conflicts_409,
    sold_out,
    gave_up,
    authorized,
    declined,
    abandoned,
    expired,
    ticketed_orders,
    failed_orders,
    canceled_orders,
    refunded_orders,
    other_final,
    timed_out,
    http_errors,
    status_polls,
    status_streams,
    status_stream_events,
    status_stream_fallbacks,
    status_polls_replaced,
);

fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One seat map snapshot and when its fetch started.
struct Snapshot {
    map: SeatMap,
    fetched_at: Instant,
}

/// The generator's single copy of the seat map, and the seats it saw taken since.
struct SharedMap {
    current: RwLock<Arc<Snapshot>>,
    /// Single-flight guard; holds when the last refresh attempt started.
    refreshing: tokio::sync::Mutex<Instant>,
    /// Seat id → when this generator saw it taken (409 or its own hold).
    taken: Mutex<HashMap<Uuid, Instant>>,
}

/// An HTTP answer read in full.
struct Reply {
    status: StatusCode,
    body: Vec<u8>,
}

/// Everything the buyer tasks share.
struct Ctx {
    cfg: BuyerConfig,
    client: BuyerClient,
    in_flight: Semaphore,
    /// Polls take one of these first, so status polling never holds more than a quarter of
    /// the in-flight slots and cannot starve holds and payments.
    poll_slots: Semaphore,
    map: SharedMap,
    /// For order streams: no total timeout, a read timeout above the server's heartbeat.
    stream_http: reqwest::Client,
    stats: Counters,
    hold_latency_us: Mutex<Histogram<u64>>,
    hold_to_ticket_us: Mutex<Histogram<u64>>,
    started: Instant,
}

/// Runs `cfg.buyers` buyers at once against the API and the Stripe simulator and returns
/// their aggregated statistics once every buyer has reached a final state, timed out or
/// given up. Errors only when the config is invalid or the seat map cannot be loaded at
/// start; everything later is counted, not returned.
pub async fn drive(cfg: BuyerConfig) -> anyhow::Result<BuyerStats> {
    cfg.validate()?;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(cfg.max_in_flight)
        .timeout(REQUEST_TIMEOUT)
        .connect_timeout(Duration::from_secs(5))
        .build()
        .context("building the HTTP client")?;
    let started = Instant::now();
    let mut ctx = Ctx {
        in_flight: Semaphore::new(cfg.max_in_flight),
        poll_slots: Semaphore::new((cfg.max_in_flight / 4).max(1)),
        client: BuyerClient::new(http, cfg.api_url.clone()),
        stream_http: reqwest::Client::builder()
            .read_timeout(STREAM_READ_TIMEOUT)
            .connect_timeout(Duration::from_secs(5))
            .build()
            .context("building the HTTP client")?,
        cfg,
        map: SharedMap {
            current: RwLock::new(Arc::new(Snapshot { map: SeatMap::default(), fetched_at: started })),
            refreshing: tokio::sync::Mutex::new(started),
            taken: Mutex::new(HashMap::new()),
        },
        stats: Counters::default(),
        hold_latency_us: Mutex::new(stats::histogram()),
        hold_to_ticket_us: Mutex::new(stats::histogram()),
        started,
    };
    let first = ctx.fetch_map().await.context("loading the seat map before the onsale")?;
    ctx.map.current = RwLock::new(Arc::new(first));
    let ctx = Arc::new(ctx);

    let bar = progress_bar(&ctx);
    let ticker = bar.clone().map(|bar| {
        let ctx = ctx.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_millis(200));
            loop {
                every.tick().await;
                bar.set_position(get(&ctx.stats.buyers));
                bar.set_message(progress_message(&ctx.stats));
            }
        })
    });

    let mut tasks = tokio::task::JoinSet::new();
    let seed_of = |i: usize| ctx.cfg.seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let queue_stats = match ctx.cfg.admission.clone() {
        AdmissionRoute::Direct => {
            for i in 0..ctx.cfg.buyers {
                let ctx = ctx.clone();
                // Distinct, reproducible stream per buyer.
                let seed = seed_of(i);
                let arrives = (ctx.cfg.arrival_rate > 0.0)
                    .then(|| ctx.started + Duration::from_secs_f64(i as f64 / ctx.cfg.arrival_rate));
                tasks.spawn(async move {
                    if let Some(at) = arrives {
                        tokio::time::sleep_until(at.into()).await;
                    }
                    let mut buyer = Buyer::new(ctx.bearer(), i, StdRng::seed_from_u64(seed));
                    buyer.run(&ctx, None).await;
                    inc(&ctx.stats.buyers);
                });
            }
            None
        }
        AdmissionRoute::Queue(pacing) => {
            // Each admitted buyer starts its purchase journey as soon as its token arrives.
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
            let bearers: Vec<Arc<str>> = (0..ctx.cfg.buyers).map(|_| ctx.bearer()).collect();
            let room = tokio::spawn(queue::run(ctx.client.clone(), ctx.cfg.event_id, bearers, pacing, tx));
            while let Some(a) = rx.recv().await {
                let ctx = ctx.clone();
                let seed = seed_of(a.idx);
                tasks.spawn(async move {
                    let mut buyer = Buyer::new(a.bearer, a.idx, StdRng::seed_from_u64(seed));
                    buyer.run(&ctx, Some(a.token)).await;
                    inc(&ctx.stats.buyers);
                });
            }
            let stats = room.await.context("the waiting-room phase died")??;
            // Buyers who never got through are done as well.
            ctx.stats.buyers.fetch_add(stats.gave_up, Ordering::Relaxed);
            Some(stats)
        }
    };
    while let Some(done) = tasks.join_next().await {
        if let Err(e) = done {
            tracing::error!(error = %e, "buyer task died");
        }
    }
    if let Some(t) = ticker {
        t.abort();
    }
    if let Some(bar) = bar {
        bar.set_position(get(&ctx.stats.buyers));
        bar.finish_with_message(progress_message(&ctx.stats));
    }
    let mut report = ctx.report();
    report.queue = queue_stats;
    Ok(report)
}

fn progress_bar(ctx: &Ctx) -> Option<ProgressBar> {
    if !ctx.cfg.progress {
        return None;
    }
    let bar = ProgressBar::with_draw_target(Some(ctx.cfg.buyers as u64), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} buyers done  {msg}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.enable_steady_tick(Duration::from_millis(200));
    Some(bar)
}

fn progress_message(s: &Counters) -> String {
    format!(
        "holds {}  ticketed {}  409s {}  errors {}",
        get(&s.holds),
        get(&s.ticketed_orders),
        get(&s.conflicts_409),
        get(&s.http_errors)
    )
}

impl Ctx {
    /// `Bearer …` for a new simulated user.
    fn bearer(&self) -> Arc<str> {
        format!("Bearer {}", (self.cfg.user_token)(Uuid::new_v4())).into()
    }

    /// Sends one request under an in-flight permit and reads the whole answer; also returns
    /// when the permit was granted (the request left the generator's queue).
    async fn send(&self, req: RequestBuilder) -> (Result<Reply, reqwest::Error>, Instant) {
        // The semaphore is never closed; without a permit we would merely exceed the cap.
        let _permit = self.in_flight.acquire().await.ok();
        let sent = Instant::now();
        let reply = async {
            let resp = req.send().await?;
            let status = resp.status();
            let body = resp.bytes().await?.to_vec();
            Ok(Reply { status, body })
        };
        (reply.await, sent)
    }

    /// Sends `build()` until it gets a definite answer: transport errors, 5xx and 429 (each
    /// counted in `http_errors`) and answers for which `busy` holds are retried unchanged
    /// with jittered exponential backoff, at most `MAX_TRIES` times. Returns the answer and
    /// when the first try was sent, or `None` when every try failed.
    async fn call(
        &self,
        build: impl Fn() -> RequestBuilder,
        busy: impl Fn(&Reply) -> bool,
    ) -> Option<(Reply, Instant)> {
        let mut first_sent = None;
        for attempt in 0..MAX_TRIES {
            let (result, sent) = self.send(build()).await;
            // From the first permit, not while queued behind other buyers.
            let first = *first_sent.get_or_insert(sent);
            match result {
                Ok(r) if r.status.is_server_error() || r.status == StatusCode::TOO_MANY_REQUESTS => {
                    inc(&self.stats.http_errors);
                    tracing::debug!(status = %r.status, "retrying after server error");
                }
                Ok(r) if busy(&r) => {}
                Ok(r) => return Some((r, first)),
                Err(e) => {
                    inc(&self.stats.http_errors);
                    tracing::debug!(error = %e, "retrying after transport error");
                }
            }
            if attempt + 1 < MAX_TRIES {
                let base = 50u64 << attempt.min(5);
                let jitter = rand::thread_rng().gen_range(0.5..1.0);
                tokio::time::sleep(Duration::from_millis((base as f64 * jitter) as u64)).await;
            }
        }
        None
    }

    /// Counts an answer this generator did not expect.
    fn unexpected(&self, what: &str, r: &Reply) {
        inc(&self.stats.http_errors);
        tracing::debug!(status = %r.status, body = %String::from_utf8_lossy(&r.body), "unexpected answer to {what}");
    }

    async fn fetch_map(&self) -> anyhow::Result<Snapshot> {
        let fetched_at = Instant::now();
        let (r, _) = self
            .call(|| self.client.seat_map(self.cfg.event_id), |_| false)
            .await
            .context("GET seats: no answer")?;
        anyhow::ensure!(r.status == StatusCode::OK, "GET seats: {}", r.status);
        let body: SeatMapBody = serde_json::from_slice(&r.body).context("GET seats: bad body")?;
        Ok(Snapshot { map: SeatMap::from_seats(body.seats), fetched_at })
    }

    /// The current snapshot; refreshes it first (one caller at a time, the others keep using
    /// the stale copy) when it is older than `MAP_REFRESH`.
    async fn snapshot(&self) -> Arc<Snapshot> {
        let current = || self.map.current.read().unwrap_or_else(PoisonError::into_inner).clone();
        let snap = current();
        if snap.fetched_at.elapsed() < MAP_REFRESH {
            return snap;
        }
        let Ok(mut last_try) = self.map.refreshing.try_lock() else {
            return snap;
        };
        if last_try.elapsed() < MAP_REFRESH {
            return current(); // refreshed (or failed) just before we got the guard
        }
        *last_try = Instant::now();
        match self.fetch_map().await {
            Ok(fresh) => {
                // Seats seen taken before the map was rendered (it is cached up to 1 s
                // server-side) are in it; later sightings must stay greyed out.
                let cutoff = fresh.fetched_at.checked_sub(MAP_REFRESH).unwrap_or(self.started);
                lock(&self.map.taken).retain(|_, seen| *seen >= cutoff);
                let fresh = Arc::new(fresh);
                *self.map.current.write().unwrap_or_else(PoisonError::into_inner) = fresh.clone();
                fresh
            }
            Err(e) => {
                inc(&self.stats.http_errors);
                tracing::warn!(error = %format!("{e:#}"), "seat map refresh failed; using the stale copy");
                snap
            }
        }
    }

    fn mark_taken(&self, seats: &[Uuid]) {
        let now = Instant::now();
        let mut taken = lock(&self.map.taken);
        for id in seats {
            taken.insert(*id, now);
        }
    }

    fn report(&self) -> BuyerStats {
        let holds = get(&self.stats.holds);
        let hold_phase_s = get(&self.stats.last_hold_ms) as f64 / 1_000.0;
        let mut stats = BuyerStats {
            hold_latency_ms: Percentiles::from_us(&lock(&self.hold_latency_us)),
            hold_to_ticket_ms: Percentiles::from_us(&lock(&self.hold_to_ticket_us)),
            elapsed_ms: self.started.elapsed().as_millis() as u64,
            holds_per_s: if hold_phase_s > 0.0 { holds as f64 / hold_phase_s } else { 0.0 },
            ..BuyerStats::default()
        };
        self.stats.copy_into(&mut stats);
        stats
    }
}

/// What a buyer does once seats are held.
enum Intent {
    Pay,
    Decline,
    Abandon,
}

/// One buyer's identity and random stream.
struct Buyer {
    bearer: Arc<str>,
    /// This buyer's client address for `X-Forwarded-For` (a deployment trusting one proxy
    /// hop then keys its per-IP buckets by buyer, not by this host).
    forwarded_for: String,
    rng: StdRng,
    saw_authorized: bool,
}

impl Buyer {
    fn new(bearer: Arc<str>, idx: usize, rng: StdRng) -> Self {
        Self { bearer, forwarded_for: crate::client::forwarded_for(idx), rng, saw_authorized: false }
    }

    /// The purchase journey; `admission` is the token from the waiting room, if any
    /// (otherwise the direct admission route is asked).
    async fn run(&mut self, ctx: &Ctx, admission: Option<String>) {
        let admission = match admission {
            Some(a) => a,
            None => match self.admit(ctx).await {
                Some(a) => a,
                None => return,
            },
        };
        let Some((order_id, held_at, ttl)) = self.hold(ctx, &admission).await else {
            return;
        };
        // The server's hold TTL decides when an abandoned order becomes final: wait at least
        // that long plus a margin for the expiry sweep and compensations.
        let wait = Duration::from_millis(ctx.cfg.final_timeout_ms).max(ttl + Duration::from_secs(120));
        let deadline = held_at + wait;
        let roll: f64 = self.rng.gen();
        let intent = if roll < ctx.cfg.abandon_share {
            Intent::Abandon
        } else if roll < ctx.cfg.abandon_share + ctx.cfg.decline_share {
            Intent::Decline
        } else {
            Intent::Pay
        };
        match intent {
            Intent::Abandon => inc(&ctx.stats.abandoned),
            Intent::Decline => self.pay(ctx, order_id, "pm_card_chargeDeclined", deadline).await,
            Intent::Pay => self.pay(ctx, order_id, "pm_card_visa", deadline).await,
        }
        // Everyone, paying or not, watches the order to its end so the report can count it.
        match self.watch(ctx, order_id, deadline, |_| false).await {
            Some(view) => {
                let counter = match view.status.as_str() {
                    "ticketed" => {
                        stats::record(&mut lock(&ctx.hold_to_ticket_us), held_at.elapsed());
                        &ctx.stats.ticketed_orders
                    }
                    "expired" => &ctx.stats.expired,
                    "failed" => &ctx.stats.failed_orders,
                    "canceled" => &ctx.stats.canceled_orders,
                    "refunded" => &ctx.stats.refunded_orders,
                    _ => &ctx.stats.other_final,
                };
                inc(counter);
            }
            None => inc(&ctx.stats.timed_out),
        }
        if self.saw_authorized {
            inc(&ctx.stats.authorized);
        }
    }

    /// `POST /events/{id}/admission` → the admission token.
    async fn admit(&self, ctx: &Ctx) -> Option<String> {
        let (r, _) = ctx
            .call(
                || {
                    ctx.client
                        .admit(&self.bearer, ctx.cfg.event_id)
                        .header("x-forwarded-for", &self.forwarded_for)
                },
                |_| false,
            )
            .await?;
        if r.status != StatusCode::CREATED {
            ctx.unexpected("admission", &r);
            return None;
        }
        match serde_json::from_slice::<Admission>(&r.body) {
            Ok(a) => Some(a.admission_token),
            Err(_) => {
                ctx.unexpected("admission", &r);
                None
            }
        }
    }

    /// Picks and holds seats, trying new picks after 409 `seat_unavailable`. Returns the
    /// order id and when the 202 arrived.
    async fn hold(&mut self, ctx: &Ctx, admission: &str) -> Option<(Uuid, Instant, Duration)> {
        let want = self.rng.gen_range(1..=ctx.cfg.max_seats);
        for _ in 0..ctx.cfg.hold_attempts {
            let snap = ctx.snapshot().await;
            let pick = {
                let taken = lock(&ctx.map.taken);
                snap.map.pick(&mut self.rng, want, |id| taken.contains_key(id))
            };
            let Some(seats) = pick else {
                inc(&ctx.stats.sold_out);
                return None;
            };
            inc(&ctx.stats.hold_attempts);
            let key = Uuid::new_v4().to_string();
            let build = || {
                ctx.client
                    .hold(&self.bearer, ctx.cfg.event_id, admission, &key, &seats)
                    .header("x-forwarded-for", &self.forwarded_for)
            };
            let busy = |r: &Reply| {
                r.status == StatusCode::CONFLICT
                    && problem(r).code.as_deref() == Some("idempotency_key_in_use")
            };
            let (r, first_sent) = ctx.call(build, busy).await?;
            match r.status {
                StatusCode::ACCEPTED => {
                    let Ok(receipt) = serde_json::from_slice::<HoldReceipt>(&r.body) else {
                        ctx.unexpected("hold", &r);
                        return None;
                    };
                    let held_at = Instant::now();
                    let latency = held_at - first_sent;
                    stats::record(&mut lock(&ctx.hold_latency_us), latency);
                    if let Some(timeline) = &ctx.cfg.hold_timeline {
                        lock(timeline).push((held_at, latency));
                    }
                    inc(&ctx.stats.holds);
                    let since_start = (held_at - ctx.started).as_millis() as u64;
                    ctx.stats.last_hold_ms.fetch_max(since_start, Ordering::Relaxed);
                    ctx.mark_taken(&seats);
                    let ttl = (receipt.expires_at - chrono::Utc::now()).to_std().unwrap_or_default();
                    return Some((receipt.order_id, held_at, ttl));
                }
                StatusCode::CONFLICT if problem(&r).code.as_deref() == Some("seat_unavailable") => {
                    inc(&ctx.stats.conflicts_409);
                    let unavailable = problem(&r).unavailable_seat_ids;
                    ctx.mark_taken(if unavailable.is_empty() { &seats } else { &unavailable });
                }
                _ => {
                    ctx.unexpected("hold", &r);
                    return None;
                }
            }
        }
        inc(&ctx.stats.gave_up);
        None
    }

    /// Waits for the order's client secret, then confirms the PaymentIntent at the simulator
    /// with the publishable key, as Stripe.js does. Counts a 402 as `declined`.
    async fn pay(&mut self, ctx: &Ctx, order_id: Uuid, card: &str, deadline: Instant) {
        let ready = |v: &OrderView| v.client_secret.is_some() && v.payment_intent_id.is_some();
        let Some(view) = self.watch(ctx, order_id, deadline, ready).await else {
            return;
        };
        let (Some(pi), Some(secret)) = (view.payment_intent_id, view.client_secret) else {
            return; // final before payment was possible (e.g. expired)
        };
        if ctx.cfg.pay_within_ms > 0 {
            let think = Duration::from_millis(self.rng.gen_range(0..=ctx.cfg.pay_within_ms));
            tokio::time::sleep(think).await;
        }
        let key = format!("confirm:{order_id}");
        let build = || {
            client::confirm_payment(
                &ctx.client.http,
                &ctx.cfg.stripe_api_base,
                &ctx.cfg.stripe_publishable_key,
                &pi,
                &secret,
                card,
                &key,
            )
        };
        let Some((r, _)) = ctx.call(build, |_| false).await else {
            return;
        };
        match r.status {
            StatusCode::OK => {}
            StatusCode::PAYMENT_REQUIRED => inc(&ctx.stats.declined),
            _ => ctx.unexpected("confirm", &r),
        }
    }

    /// Follows the order until it is final or `done` holds (`None` at the deadline): by its
    /// event stream under [`OrderStatusMode::Stream`], polling when the stream is refused or
    /// keeps breaking.
    async fn watch(
        &mut self,
        ctx: &Ctx,
        order_id: Uuid,
        deadline: Instant,
        done: impl Fn(&OrderView) -> bool,
    ) -> Option<OrderView> {
        if ctx.cfg.order_status == OrderStatusMode::Stream {
            let started = Instant::now();
            for _ in 0..STREAM_TRIES {
                match self.stream(ctx, order_id, deadline, &done).await {
                    Streamed::Seen(view) => {
                        let covered = polls_for(started.elapsed(), ctx.cfg.poll_interval_ms);
                        ctx.stats.status_polls_replaced.fetch_add(covered, Ordering::Relaxed);
                        return Some(view);
                    }
                    Streamed::Deadline => return None,
                    Streamed::Closed => {}
                    Streamed::Refused => break,
                }
            }
            inc(&ctx.stats.status_stream_fallbacks);
            let covered = polls_for(started.elapsed(), ctx.cfg.poll_interval_ms);
            ctx.stats.status_polls_replaced.fetch_add(covered, Ordering::Relaxed);
        }
        self.poll(ctx, order_id, deadline, done).await
    }

    /// One `GET /orders/{id}/events` stream, read until the order is final or `done` holds.
    async fn stream(
        &mut self,
        ctx: &Ctx,
        order_id: Uuid,
        deadline: Instant,
        done: &impl Fn(&OrderView) -> bool,
    ) -> Streamed {
        let deadline = tokio::time::Instant::from_std(deadline);
        inc(&ctx.stats.status_streams);
        let send = ctx
            .client
            .order_events(&ctx.stream_http, &self.bearer, order_id)
            .header("x-forwarded-for", &self.forwarded_for)
            .send();
        let mut resp = match tokio::time::timeout_at(deadline, send).await {
            Err(_) => return Streamed::Deadline,
            Ok(Err(_)) => {
                inc(&ctx.stats.http_errors);
                return Streamed::Closed;
            }
            Ok(Ok(r)) if r.status() == StatusCode::OK => r,
            Ok(Ok(r)) => {
                // 429 `too_many_streams` or an error: poll instead.
                if r.status().is_server_error() {
                    inc(&ctx.stats.http_errors);
                }
                return Streamed::Refused;
            }
        };
        let mut buf = String::new();
        let mut last: Option<OrderView> = None;
        loop {
            match tokio::time::timeout_at(deadline, resp.chunk()).await {
                Err(_) => return Streamed::Deadline,
                Ok(Ok(Some(bytes))) => buf.push_str(&String::from_utf8_lossy(&bytes)),
                Ok(Ok(None)) => {
                    return match last {
                        Some(v) if v.is_final() => Streamed::Seen(v),
                        _ => Streamed::Closed,
                    };
                }
                Ok(Err(_)) => {
                    inc(&ctx.stats.http_errors);
                    return Streamed::Closed;
                }
            }
            for ev in client::take_sse_events(&mut buf) {
                match ev.event.as_str() {
                    "order" => {
                        inc(&ctx.stats.status_stream_events);
                        let Ok(view) = serde_json::from_str::<OrderView>(&ev.data) else {
                            inc(&ctx.stats.http_errors);
                            continue;
                        };
                        if matches!(view.status.as_str(), "confirming" | "paid" | "ticketed") {
                            self.saw_authorized = true;
                        }
                        if view.is_final() || done(&view) {
                            return Streamed::Seen(view);
                        }
                        last = Some(view);
                    }
                    "end" => {
                        if let Some(v) = last.take() {
                            return Streamed::Seen(v);
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    /// Polls `GET /orders/{id}` until the order is final or `done` holds; `None` at the
    /// deadline. The interval starts at `poll_interval_ms` and backs off ×1.5 up to 4× with
    /// ±20 % jitter, as a well-behaved client does. Notes whether payment was seen authorized.
    async fn poll(
        &mut self,
        ctx: &Ctx,
        order_id: Uuid,
        deadline: Instant,
        done: impl Fn(&OrderView) -> bool,
    ) -> Option<OrderView> {
        let base = ctx.cfg.poll_interval_ms.max(1) as f64;
        let mut interval_ms = base;
        loop {
            inc(&ctx.stats.status_polls);
            let answer = {
                let _slot = ctx.poll_slots.acquire().await.ok();
                ctx.call(
                    || {
                        ctx.client
                            .order(&self.bearer, order_id)
                            .header("x-forwarded-for", &self.forwarded_for)
                    },
                    |_| false,
                )
                .await
            };
            match answer {
                Some((r, _)) if r.status == StatusCode::OK => {
                    match serde_json::from_slice::<OrderView>(&r.body) {
                        Ok(view) => {
                            if matches!(view.status.as_str(), "confirming" | "paid" | "ticketed") {
                                self.saw_authorized = true;
                            }
                            if view.is_final() || done(&view) {
                                return Some(view);
                            }
                        }
                        Err(_) => ctx.unexpected("order poll", &r),
                    }
                }
                Some((r, _)) => ctx.unexpected("order poll", &r),
                None => {} // already counted by `call`
            }
            let interval =
                Duration::from_millis((interval_ms * rand::thread_rng().gen_range(0.8..1.2)) as u64);
            interval_ms = (interval_ms * 1.5).min(base * 4.0);
            if Instant::now() + interval > deadline {
                return None;
            }
            tokio::time::sleep(interval).await;
        }
    }
}

/// How one order stream ended.
enum Streamed {
    /// The order reached a final state or the awaited one.
    Seen(OrderView),
    /// The buyer's deadline passed.
    Deadline,
    /// The stream closed or broke before that: open another.
    Closed,
    /// The server refused the stream (e.g. 429 `too_many_streams`): poll.
    Refused,
}

/// How many `GET /orders/{id}` a poller starting at `base_ms` and backing off ×1.5 up to 4×
/// (jitter averages out) makes in `elapsed`: the first at once, then one per interval.
pub fn polls_for(elapsed: Duration, base_ms: u64) -> u64 {
    let base = base_ms.max(1) as f64;
    let (mut t, mut interval, mut n) = (0.0, base, 1u64);
    let total = elapsed.as_secs_f64() * 1000.0;
    while t + interval <= total {
        t += interval;
        interval = (interval * 1.5).min(base * 4.0);
        n += 1;
    }
    n
}

/// The problem+json body of an answer (empty when it has none).
fn problem(r: &Reply) -> Problem {
    Problem::parse(&r.body)
}

#[cfg(test)]
mod tests {
    use super::polls_for;
    use std::time::Duration;

    #[test]
    fn a_poller_backs_off_to_four_times_its_interval() {
        // 0, 1000, 2500, 4750, 8125, then every 4000 ms (12125, 16125, …) with a 1 s base.
        assert_eq!(polls_for(Duration::ZERO, 1_000), 1);
        assert_eq!(polls_for(Duration::from_millis(999), 1_000), 1);
        assert_eq!(polls_for(Duration::from_millis(2_500), 1_000), 3);
        assert_eq!(polls_for(Duration::from_millis(16_125), 1_000), 7);
        assert_eq!(polls_for(Duration::from_secs(60), 1_000), 17);
    }
}
