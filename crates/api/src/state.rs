//! Shared state of the API role.

use crate::limits::{FallbackLimiter, RateLimits};
use crate::revocation::Revocations;
use boxoffice_admission::{AdmissionTokens, UserTokens};
use boxoffice_store::venue::SalesWindow;
use boxoffice_waitroom::Waitroom;
use bytes::Bytes;
use metrics_exporter_prometheus::PrometheusHandle;
use rdkafka::producer::FutureProducer;
use secrecy::SecretString;
use sqlx::PgPool;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Rendered seat maps by event (`None`: no such event), each kept `seat_map_max_age_ms`;
/// one render per event at a time (`try_get_with` is single-flight per key), bounded in
/// entries.
pub type SeatMapCache = moka::future::Cache<Uuid, Option<Bytes>>;
use uuid::Uuid;

/// API tuning.
#[derive(Debug, Clone)]
pub struct ApiSettings {
    /// The hold's lifetime rules: its TTL, and how long an authorization reported by a webhook
    /// protects it ([`boxoffice_domain::hold`]).
    pub hold_policy: boxoffice_domain::HoldPolicy,
    /// How a hold asks for its order's authorization (configuration
    /// `hold_fact_requests_authorization`; [`boxoffice_domain::saga::AuthorizationRequest`]).
    pub authorization_request: boxoffice_domain::saga::AuthorizationRequest,
    /// Admission token lifetime (the admission slot), seconds.
    pub admission_ttl_s: i64,
    /// How long a rendered seat map may be served, ms.
    pub seat_map_max_age_ms: u64,
    /// Stripe webhook endpoint secret (`whsec_…`; secret, `Debug` redacts it).
    pub webhook_secret: SecretString,
    /// Allowed clock skew for webhook timestamps, seconds.
    pub webhook_tolerance_s: i64,
    /// Largest accepted request body, bytes (→ 413 beyond).
    pub max_body_bytes: usize,
    /// Serve `POST /events/{id}/admission` (admission without the queue: dev and tests).
    pub admission_direct: bool,
    /// The release rate the estimated wait assumes, positions per second (0 = no estimate).
    pub release_per_s: f64,
    /// Poll interval suggested to queued clients, ms.
    pub poll_interval_ms: u64,
    /// Rate buckets of every buyer route class (see [`crate::limits`]).
    pub rate_limits: RateLimits,
    /// Proxies of this deployment in front of the API that append to `X-Forwarded-For`
    /// (0 = ignore the header; see [`crate::edge::client_ip`]).
    pub trusted_proxy_hops: u32,
    /// Events (found or not) whose seat map is kept at once, entries.
    pub seat_map_cache_entries: u64,
    /// Requests one client address may have in flight at once on the buyer routes (0 = no
    /// limit; see [`crate::edge::PerClientInFlight`]).
    pub max_in_flight_per_ip: usize,
    /// The same on webhook ingress, whose bodies are read before the signature is checked.
    pub webhook_max_in_flight_per_ip: usize,
    /// Waiting-room requests (join, poll, leave) in flight at once per process (≥ 1); one
    /// more is 503 `overloaded` at once. A bulkhead: a crowd polling a slow Redis waits up
    /// to `queue_timeout_ms` per request, and must not take the slots of holds and webhooks.
    pub queue_max_concurrent: usize,
    /// Hold requests in flight at once per process (≥ 1); one more is 503 `overloaded` at
    /// once. A bulkhead: admitted buyers with slow bodies must not take the slots of the seat
    /// map, order status, the queue and webhooks.
    pub holds_max_concurrent: usize,
    /// The most webhook events recorded in one transaction (≥ 1; see
    /// [`crate::webhooks::Ingress`]).
    pub webhook_batch_max: usize,
    /// Longest a webhook request may take, body included (Stripe sends a whole small body at
    /// once); past it 503 `request_timeout`.
    pub webhook_timeout: Duration,
    /// Networks webhook ingress accepts requests from (Stripe publishes its webhook
    /// addresses); empty = any. Others get 403 `webhook_source_refused` before the body is read.
    pub webhook_allowed_networks: Vec<ipnet::IpNet>,
    /// The region and purchase cell on the API's spans (design §16).
    pub labels: boxoffice_trace::Labels,
    /// The operator's bearer token of the `/admin` routes (secret, `Debug` redacts it; empty:
    /// every operator request is refused). See [`crate::admin::Operator`].
    pub admin_token: SecretString,
    /// Requests one client address may have in flight at once on the `/admin` routes (0 = no
    /// limit).
    pub admin_max_in_flight_per_ip: usize,
}

impl Default for ApiSettings {
    fn default() -> Self {
        Self {
            hold_policy: boxoffice_domain::HoldPolicy::for_ttl(Duration::from_secs(300)),
            authorization_request: Default::default(),
            admission_ttl_s: 900,
            seat_map_max_age_ms: 1_000,
            webhook_secret: SecretString::default(),
            webhook_tolerance_s: 300,
            max_body_bytes: 64 * 1024,
            admission_direct: false,
            release_per_s: 0.0,
            poll_interval_ms: 2_000,
            rate_limits: RateLimits::default(),
            trusted_proxy_hops: 0,
            seat_map_cache_entries: 10_000,
            max_in_flight_per_ip: 32,
            webhook_max_in_flight_per_ip: 8,
            queue_max_concurrent: 256,
            holds_max_concurrent: 256,
            webhook_batch_max: crate::webhooks::DEFAULT_BATCH_MAX,
            webhook_timeout: Duration::from_secs(3),
            webhook_allowed_networks: Vec::new(),
            labels: boxoffice_trace::Labels::default(),
            admin_token: SecretString::default(),
            admin_max_in_flight_per_ip: 4,
        }
    }
}

/// How long a sales window (or an event's absence) read from the ledger is served from memory.
/// A schedule change reaches the waiting room's joins within this time; the hold transaction
/// always reads the ledger itself.
pub const EVENT_CACHE_TTL: std::time::Duration = std::time::Duration::from_secs(2);

/// An event as the API reads it from its cell's ledger: the sales window and where it is sold.
#[derive(Debug, Clone)]
pub struct EventInfo {
    /// The sales window.
    pub window: SalesWindow,
    /// Which cell sells it, at which directory epoch, and whether this ledger may.
    pub placement: boxoffice_store::cells::Placement,
}

/// An event read from the ledger at an instant (`None`: no such event).
pub type CachedWindow = (Instant, Option<EventInfo>);

/// Everything a handler needs; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    /// The ledger.
    pub pool: PgPool,
    /// Stripe webhook ingress's group commit, on a pool of its own, so a burst of hold
    /// requests cannot delay the facts that move paid orders forward.
    pub webhooks: crate::webhooks::Ingress,
    /// Bearer-token verification (the identity provider's keys; HS256 in development).
    pub users: UserTokens,
    /// Admission-token signing and verification.
    pub admission: AdmissionTokens,
    /// The waiting room (Redis): queue, rate buckets, revocation set.
    pub waitroom: Waitroom,
    /// Each event's sales window and placement as last read from the ledger (`None`: no such event), with
    /// when it was read, so queue joins in a stampede do not each ask the ledger; entries
    /// live [`EVENT_CACHE_TTL`].
    pub event_windows: Arc<Mutex<HashMap<Uuid, CachedWindow>>>,
    /// Tuning.
    pub settings: Arc<ApiSettings>,
    /// The producer whose health `/readyz` reports (absent when no relay runs here).
    pub producer: Option<FutureProducer>,
    /// Prometheus exposition for `/metrics`.
    pub metrics: Option<PrometheusHandle>,
    /// Rendered seat maps, misses included.
    pub seat_maps: SeatMapCache,
    /// The admission-token revocation check (Redis, then the ledger when Redis cannot vouch).
    pub revocations: Revocations,
    /// The rate buckets' stand-in while Redis cannot answer.
    pub fallback_limiter: Arc<FallbackLimiter>,
    /// This process's region lease (design §15), when a witness is configured: holds and
    /// webhooks answer 503 `region_fenced` and `/readyz` 503 while it is lapsed.
    pub region_lease: Option<Arc<boxoffice_store::region::LeaseGate>>,
    /// The payment provider, for the operator's order timeline (its view of each
    /// PaymentIntent); `None` when none is configured.
    pub payment_gateway: Option<Arc<dyn boxoffice_payments::PaymentGateway>>,
    /// The buyers' live order streams (`GET /orders/{id}/events`) and their wake-ups.
    pub order_streams: Arc<crate::order_stream::OrderStreams>,
    /// The operator's onsale view: per-event conflict counts, the latest audit and dead-letter
    /// readings, the rendered `/admin/onsale` ([`crate::dashboard`]).
    pub dashboard: crate::dashboard::Dashboard,
}

impl AppState {
    /// Builds the state.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        pool: PgPool,
        webhook_pool: PgPool,
        users: UserTokens,
        admission: AdmissionTokens,
        waitroom: Waitroom,
        settings: ApiSettings,
        producer: Option<FutureProducer>,
        metrics: Option<PrometheusHandle>,
    ) -> Self {
        let seat_maps = moka::future::Cache::builder()
            .max_capacity(settings.seat_map_cache_entries.max(1))
            .time_to_live(Duration::from_millis(settings.seat_map_max_age_ms.max(1)))
            .build();
        Self {
            revocations: Revocations::new(pool.clone(), waitroom.clone()),
            webhooks: crate::webhooks::Ingress::start(
                webhook_pool,
                settings.hold_policy,
                settings.webhook_batch_max,
                settings.webhook_timeout,
            ),
            pool,
            users,
            admission,
            waitroom,
            event_windows: Arc::default(),
            settings: Arc::new(settings),
            producer,
            metrics,
            seat_maps,
            fallback_limiter: Arc::default(),
            region_lease: None,
            order_streams: crate::order_stream::OrderStreams::new(Default::default()),
            payment_gateway: None,
            dashboard: crate::dashboard::Dashboard::default(),
        }
    }

    /// This state with the payment provider the operator's timeline asks.
    pub fn with_payment_gateway(
        mut self,
        gateway: Option<Arc<dyn boxoffice_payments::PaymentGateway>>,
    ) -> Self {
        self.payment_gateway = gateway;
        self
    }

    /// This state with order streams bounded by `settings`.
    pub fn with_order_streams(mut self, settings: crate::order_stream::StreamSettings) -> Self {
        self.order_streams = crate::order_stream::OrderStreams::new(settings);
        self
    }

    /// This state with the process's region lease gate.
    pub fn with_region_lease(mut self, gate: Option<Arc<boxoffice_store::region::LeaseGate>>) -> Self {
        self.region_lease = gate;
        self
    }

    /// Whether this process may write: no lease configured, or the lease holds.
    pub fn may_write(&self) -> bool {
        self.region_lease.as_ref().is_none_or(|g| g.is_valid())
    }
}
