//! boxoffice-stripe-sim: a small stateful in-memory server that speaks Stripe's real HTTP API
//! for the calls boxoffice makes, so the production `StripeClient` needs only another base URL.
//!
//! Owns: PaymentIntents/charges/refunds and their lifecycle (`state`), Stripe's idempotency
//! rules (`idempotency`), signed at-least-once webhooks (`webhooks`), fault injection
//! (`faults`) and the HTTP surface (`routes`), plus a test clock for authorization expiry.
//!
//! Supported: `POST /v1/payment_intents`, `GET /v1/payment_intents[/{id}]` (the list pages
//! newest first with `limit`, `starting_after` and `created[gt|gte|lt|lte]`, and expands
//! `data.latest_charge`),
//! `POST /v1/payment_intents/{id}/{confirm,capture,cancel}`, `POST /v1/refunds`,
//! `GET /v1/refunds/{id}`, `GET /v1/charges/{id}`; unauthenticated controls
//! `POST /_sim/faults` (JSON [`Faults`]), `GET /_sim/faults`, `POST /_sim/clock/advance`
//! (`{"seconds": N}`), `GET /_sim/stats` ([`SimStats`]). Test cards: `pm_card_visa`,
//! `pm_card_mastercard` (approve), `pm_card_chargeDeclined`,
//! `pm_card_chargeDeclinedInsufficientFunds` (decline). Keys: any `sk_test_…`; `pk_test_…`
//! with the intent's client secret for confirm and retrieve.
//!
//! Invariant: the simulator never applies a mutation twice for one idempotency key, and every
//! state change queues its events before the lock is released, so webhooks can be late,
//! duplicated or reordered (by faults) but never missing while an endpoint is configured.
//! It is a test double: state lives in memory only and is lost on exit.

#![warn(missing_docs)]

mod api;
mod faults;
mod idempotency;
mod routes;
mod state;
mod webhooks;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

pub use faults::{Faults, FAULT_HEADER};
pub use webhooks::MAX_CONCURRENT_DELIVERIES;

use faults::FaultState;
use idempotency::IdempotencyStore;
use state::State;
use webhooks::WebhookQueue;

/// Simulator configuration.
#[derive(Clone)]
pub struct SimConfig {
    /// Where to POST events (e.g. `http://127.0.0.1:8080/webhooks/stripe`); `None` drops them.
    pub webhook_url: Option<String>,
    /// The endpoint's signing secret (`whsec_…`), shared with the receiver's `webhook::verify`
    /// (secret: `Debug` redacts it).
    pub webhook_secret: SecretString,
    /// Initial faults (default: none).
    pub faults: Faults,
    /// Delivery attempts per event copy, first included (default 12).
    pub webhook_max_attempts: u32,
    /// Backoff before the second attempt in ms (default 100); doubles per attempt, capped at 5 s.
    pub webhook_initial_backoff_ms: u64,
    /// The endpoint's `enabled_events` (<https://docs.stripe.com/api/webhook_endpoints/object>):
    /// only these event types are delivered. Empty means every type (`*`).
    pub webhook_events: Vec<String>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            webhook_url: None,
            webhook_secret: "whsec_boxoffice_sim".into(),
            faults: Faults::default(),
            webhook_max_attempts: 12,
            webhook_initial_backoff_ms: 100,
            webhook_events: Vec::new(),
        }
    }
}

impl fmt::Debug for SimConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimConfig")
            .field("webhook_url", &self.webhook_url)
            .field("webhook_secret", &self.webhook_secret)
            .field("faults", &self.faults)
            .field("webhook_max_attempts", &self.webhook_max_attempts)
            .field("webhook_initial_backoff_ms", &self.webhook_initial_backoff_ms)
            .finish()
    }
}

/// Counters since start, for assertions and `GET /_sim/stats`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct SimStats {
    /// `POST /v1/payment_intents` that created an intent (replays excluded).
    pub payment_intents_created: u64,
    /// Confirmations that authorized (manual) or charged (automatic).
    pub confirmations_succeeded: u64,
    /// Confirmations declined by a test card (402).
    pub confirmations_declined: u64,
    /// Distinct successful capture operations (idempotent replays are not counted).
    pub captures_applied: u64,
    /// Explicit cancels (expiries are counted in `authorizations_expired`).
    pub cancels: u64,
    /// Authorizations canceled automatically after `capture_before`.
    pub authorizations_expired: u64,
    /// Refunds created.
    pub refunds: u64,
    /// Requests answered from the idempotency store.
    pub idempotent_replays: u64,
    /// Read-only `/v1` requests (a retrieve or a list) that looked the ledger up, counted when
    /// they did, before any [`Faults::answer_delay_ms`].
    #[serde(default)]
    pub reads: u64,
    /// Events created (each is delivered once plus `webhook_duplicates` times).
    pub events_emitted: u64,
    /// HTTP POSTs to the webhook endpoint, retries and duplicates included.
    pub webhook_deliveries_attempted: u64,
    /// POSTs answered with 2xx.
    pub webhook_deliveries_succeeded: u64,
    /// Event copies given up on after `webhook_max_attempts`.
    pub webhook_deliveries_abandoned: u64,
    /// Captures per captured intent (absent = 0). Anything above 1 is a double capture.
    pub captures_per_payment_intent: BTreeMap<String, u32>,
    /// Most `/v1` requests ever in progress at once (what a client's concurrency cap bounds).
    #[serde(default)]
    pub peak_requests_in_flight: u64,
}

/// The simulator: a cheap-to-clone handle (`Arc` inside) shared by routes and tests.
#[derive(Clone)]
pub struct StripeSim {
    shared: Arc<Shared>,
}

struct Shared {
    ledger: Mutex<State>,
    idempotency: IdempotencyStore,
    faults: Mutex<FaultState>,
    webhooks: WebhookQueue,
    webhook_url: Mutex<Option<String>>,
    webhook_secret: String,
    webhook_max_attempts: u32,
    webhook_initial_backoff_ms: u64,
    webhook_events: Vec<String>,
    /// Test-clock offset from wall-clock time, seconds.
    clock_offset_s: AtomicI64,
    idempotent_replays: AtomicU64,
    reads: AtomicU64,
    /// `/v1` requests in progress, and the most there ever were.
    in_flight: AtomicU64,
    peak_in_flight: AtomicU64,
    /// Cancelled when serving stops: releases requests whose answer a fault dropped.
    hangup: CancellationToken,
}

/// One `/v1` request in progress, counted until dropped (the answer sent or the request
/// abandoned).
pub(crate) struct InFlight(StripeSim);

impl InFlight {
    pub(crate) fn start(sim: &StripeSim) -> Self {
        let now = sim.shared.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        sim.shared.peak_in_flight.fetch_max(now, Ordering::Relaxed);
        Self(sim.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.shared.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl StripeSim {
    /// A simulator with no objects. Nothing is served or delivered until [`StripeSim::serve`]
    /// (or [`StripeSim::router`] plus [`StripeSim::run_webhook_delivery`]).
    pub fn new(cfg: SimConfig) -> Self {
        Self {
            shared: Arc::new(Shared {
                ledger: Mutex::new(State::default()),
                idempotency: IdempotencyStore::default(),
                faults: Mutex::new(FaultState::new(cfg.faults)),
                webhooks: WebhookQueue::new(),
                webhook_url: Mutex::new(cfg.webhook_url),
                webhook_secret: cfg.webhook_secret.expose_secret().to_owned(),
                webhook_max_attempts: cfg.webhook_max_attempts,
                webhook_initial_backoff_ms: cfg.webhook_initial_backoff_ms,
                webhook_events: cfg.webhook_events,
                clock_offset_s: AtomicI64::new(0),
                idempotent_replays: AtomicU64::new(0),
                reads: AtomicU64::new(0),
                in_flight: AtomicU64::new(0),
                peak_in_flight: AtomicU64::new(0),
                hangup: CancellationToken::new(),
            }),
        }
    }

    /// All `/v1` and `/_sim` routes, with this simulator as state.
    pub fn router(&self) -> axum::Router {
        routes::router(self.clone())
    }

    /// Serves the API on `listener` and runs webhook delivery until `shutdown` is cancelled,
    /// then stops accepting, releases requests held by `drop-response` faults, waits for
    /// in-flight requests and returns. Errors only if the listener fails.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: CancellationToken,
    ) -> std::io::Result<()> {
        let delivery = tokio::spawn(self.clone().run_webhook_delivery(shutdown.clone()));
        let hangup = self.shared.hangup.clone();
        let served = axum::serve(listener, self.router())
            .with_graceful_shutdown(async move {
                shutdown.cancelled().await;
                hangup.cancel();
            })
            .await;
        if let Err(e) = delivery.await {
            tracing::error!(error = %e, "webhook delivery task panicked");
        }
        served
    }

    /// The webhook delivery loop (already run by [`StripeSim::serve`]); for callers that mount
    /// [`StripeSim::router`] themselves. Returns when `shutdown` is cancelled; a second
    /// concurrent call returns at once.
    pub async fn run_webhook_delivery(self, shutdown: CancellationToken) {
        webhooks::run(self, shutdown).await;
    }

    /// Replaces the faults (and re-seeds the fault RNG from `f.seed`).
    pub fn set_faults(&self, f: Faults) {
        lock(&self.shared.faults).set(f);
    }

    /// The current faults.
    pub fn faults(&self) -> Faults {
        lock(&self.shared.faults).faults.clone()
    }

    /// Changes the webhook endpoint; applies to the next delivery attempt.
    pub fn set_webhook_url(&self, url: Option<String>) {
        *lock(&self.shared.webhook_url) = url;
    }

    /// Moves the test clock forward by `secs` (negative moves it back). Affects `created`,
    /// event timestamps and authorization expiry; authorizations whose `capture_before` is now
    /// past are canceled at once (emitting `payment_intent.canceled`). Webhook signatures keep
    /// using wall-clock time.
    pub fn advance_clock(&self, secs: i64) {
        self.shared.clock_offset_s.fetch_add(secs, Ordering::SeqCst);
        self.with_ledger(self.now(), |_| ());
    }

    /// The simulator's current time, unix seconds (wall clock plus test-clock offset).
    pub fn now(&self) -> i64 {
        let wall = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        wall + self.shared.clock_offset_s.load(Ordering::SeqCst)
    }

    /// The intent as `GET /v1/payment_intents/{id}` would render it, `None` if unknown.
    pub fn payment_intent(&self, id: &str) -> Option<serde_json::Value> {
        self.with_ledger(self.now(), |st| st.payment_intent_json(id))
    }

    /// The cardholder's bank disputes the captured charge of `payment_intent`; returns the
    /// dispute id (`dp_…`). Emits `charge.dispute.created`.
    pub fn open_dispute(&self, payment_intent: &str) -> Result<String, String> {
        let now = self.now();
        self.with_ledger(now, |st| st.open_dispute(payment_intent, now))
            .map(|d| d["id"].as_str().unwrap_or_default().to_owned())
            .map_err(|e| format!("{}", serde_json::Value::Object(e.error)))
    }

    /// Closes dispute `id`, `won` or lost. Emits `charge.dispute.closed`.
    pub fn close_dispute(&self, id: &str, won: bool) -> Result<(), String> {
        let now = self.now();
        self.with_ledger(now, |st| st.close_dispute(id, won, now))
            .map(|_| ())
            .map_err(|e| format!("{}", serde_json::Value::Object(e.error)))
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> SimStats {
        let ledger = lock(&self.shared.ledger);
        let (c, hooks) = (&ledger.counters, &self.shared.webhooks);
        SimStats {
            payment_intents_created: c.payment_intents_created,
            confirmations_succeeded: c.confirmations_succeeded,
            confirmations_declined: c.confirmations_declined,
            captures_applied: c.captures_applied,
            cancels: c.cancels,
            authorizations_expired: c.authorizations_expired,
            refunds: c.refunds,
            idempotent_replays: self.shared.idempotent_replays.load(Ordering::Relaxed),
            reads: self.shared.reads.load(Ordering::Relaxed),
            events_emitted: c.events_emitted,
            webhook_deliveries_attempted: hooks.attempted.load(Ordering::Relaxed),
            webhook_deliveries_succeeded: hooks.succeeded.load(Ordering::Relaxed),
            webhook_deliveries_abandoned: hooks.abandoned.load(Ordering::Relaxed),
            captures_per_payment_intent: c
                .captures_per_payment_intent
                .iter()
                .map(|(k, v)| (k.clone(), *v))
                .collect(),
            peak_requests_in_flight: self.shared.peak_in_flight.load(Ordering::Relaxed),
        }
    }

    /// How many times the intent was captured (0 if never or unknown). Must never exceed 1.
    pub fn captures_for(&self, payment_intent_id: &str) -> u32 {
        lock(&self.shared.ledger)
            .counters
            .captures_per_payment_intent
            .get(payment_intent_id)
            .copied()
            .unwrap_or(0)
    }

    /// Waits until no webhook is queued or being attempted; false if `timeout` passes first.
    pub async fn wait_webhooks_idle(&self, timeout: Duration) -> bool {
        self.shared.webhooks.wait_idle(timeout).await
    }

    /// Runs `f` on the ledger after lapsing due authorizations, then queues the events emitted.
    fn with_ledger<R>(&self, now: i64, f: impl FnOnce(&mut State) -> R) -> R {
        let mut st = lock(&self.shared.ledger);
        st.expire_due(now);
        let out = f(&mut st);
        // Queue under the lock so events enter the queue in emission order.
        let enabled = &self.shared.webhook_events;
        let events = st
            .take_events()
            .into_iter()
            .filter(|e| enabled.is_empty() || enabled.iter().any(|t| e["type"].as_str() == Some(t.as_str())))
            .collect();
        self.shared.webhooks.enqueue(events);
        out
    }

    fn with_fault_state<R>(&self, f: impl FnOnce(&mut FaultState) -> R) -> R {
        f(&mut lock(&self.shared.faults))
    }

    fn webhook_url(&self) -> Option<String> {
        lock(&self.shared.webhook_url).clone()
    }

    fn count_replay(&self) {
        self.shared.idempotent_replays.fetch_add(1, Ordering::Relaxed);
    }

    fn count_read(&self) {
        self.shared.reads.fetch_add(1, Ordering::Relaxed);
    }
}
