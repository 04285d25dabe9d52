//! Shared state of the API role.

use boxoffice_admission::{AdmissionTokens, UserTokens};
use boxoffice_store::venue::SalesWindow;
use boxoffice_waitroom::{Bucket, Waitroom};
use bytes::Bytes;
use metrics_exporter_prometheus::PrometheusHandle;
use rdkafka::producer::FutureProducer;
use secrecy::SecretString;
use sqlx::PgPool;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use uuid::Uuid;

/// API tuning.
#[derive(Debug, Clone)]
pub struct ApiSettings {
    /// Hold time to live.
    pub hold_ttl: Duration,
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
    /// Per-IP bucket of the waiting-room routes (`None` = off).
    pub ip_bucket: Option<Bucket>,
    /// Per-user bucket of the waiting-room routes (`None` = off).
    pub user_bucket: Option<Bucket>,
    /// Client IP from the last `X-Forwarded-For` entry instead of the socket.
    pub trust_forwarded_for: bool,
}

impl Default for ApiSettings {
    fn default() -> Self {
        Self {
            hold_ttl: Duration::from_secs(300),
            admission_ttl_s: 900,
            seat_map_max_age_ms: 1_000,
            webhook_secret: SecretString::default(),
            webhook_tolerance_s: 300,
            max_body_bytes: 64 * 1024,
            admission_direct: false,
            release_per_s: 0.0,
            poll_interval_ms: 2_000,
            ip_bucket: None,
            user_bucket: None,
            trust_forwarded_for: false,
        }
    }
}

/// How long a sales window (or an event's absence) read from the ledger is served from memory.
/// A schedule change reaches the waiting room's joins within this time; the hold transaction
/// always reads the ledger itself.
pub const EVENT_CACHE_TTL: std::time::Duration = std::time::Duration::from_secs(2);

/// A sales window read from the ledger at an instant (`None`: no such event).
pub type CachedWindow = (Instant, Option<SalesWindow>);

/// Everything a handler needs; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    /// The ledger.
    pub pool: PgPool,
    /// A separate pool for Stripe webhook ingress, so a burst of hold requests cannot delay
    /// the facts that move paid orders forward.
    pub webhook_pool: PgPool,
    /// Bearer-token verification (the identity provider's keys; HS256 in development).
    pub users: UserTokens,
    /// Admission-token signing and verification.
    pub admission: AdmissionTokens,
    /// The waiting room (Redis): queue, rate buckets, revocation set.
    pub waitroom: Waitroom,
    /// Each event's sales window as last read from the ledger (`None`: no such event), with
    /// when it was read, so queue joins in a stampede do not each ask the ledger; entries
    /// live [`EVENT_CACHE_TTL`].
    pub event_windows: Arc<Mutex<HashMap<Uuid, CachedWindow>>>,
    /// Tuning.
    pub settings: Arc<ApiSettings>,
    /// The producer whose health `/readyz` reports (absent when no relay runs here).
    pub producer: Option<FutureProducer>,
    /// Prometheus exposition for `/metrics`.
    pub metrics: Option<PrometheusHandle>,
    /// Rendered seat maps per event, with the instant they were rendered.
    pub seat_maps: Arc<Mutex<HashMap<Uuid, (Instant, Bytes)>>>,
    /// Serializes seat-map rendering so a cache miss under load renders once.
    pub seat_map_render: Arc<tokio::sync::Mutex<()>>,
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
        Self {
            pool,
            webhook_pool,
            users,
            admission,
            waitroom,
            event_windows: Arc::default(),
            settings: Arc::new(settings),
            producer,
            metrics,
            seat_maps: Arc::default(),
            seat_map_render: Arc::default(),
        }
    }
}
