//! The one typed configuration of every role, loaded once at start-up: defaults (documented
//! on each field) → an optional TOML file (`--config` / `BOXOFFICE_CONFIG`) → `BOXOFFICE_*`
//! environment variables (e.g. `BOXOFFICE_DATABASE_URL`, `BOXOFFICE_KAFKA_BROKERS`,
//! `BOXOFFICE_HOLD_TTL_MS`). Validated before anything starts; secrets are
//! [`secrecy::SecretString`] and never printed (`Debug` redacts them).

use anyhow::{bail, Context};
use boxoffice_admission::{AdmissionSigningKey, AdmissionTokens, AdmissionVerifyingKey};
use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// An admission-token verification key besides the signing key's own public half: a retired
/// signing key kept until the tokens it signed have expired (`admission_ttl_s`), or the next
/// key, listed before it starts signing so every instance already accepts its tokens.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct AdmissionPublicKey {
    /// Key id, as in the tokens' header.
    pub kid: String,
    /// Ed25519 public key: SPKI PEM (`-----BEGIN PUBLIC KEY-----`) or a path to such a file.
    pub public_key: String,
}

fn redact<S: serde::Serializer>(_: &SecretString, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str("[redacted]")
}

/// Every setting. Durations are milliseconds unless the name says otherwise.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Config {
    /// PostgreSQL URL (may contain a password: secret). Default
    /// `postgres://postgres@127.0.0.1:5432/boxoffice`.
    #[serde(serialize_with = "redact")]
    pub database_url: SecretString,
    /// Connections for one-off commands (migrate, seed, audit, onsale bookkeeping).
    pub db_max_connections: u32,
    /// Pool of the API role. Each role has its own pool (a bulkhead: a burst of hold
    /// requests cannot starve the saga of connections). Budget (design §12): the sum of the
    /// pools of every process ≤ PostgreSQL `max_connections` (100 by default) minus
    /// operations; defaults: 20 + 4 + 3 + 9 + 9 + 9 + 2 = 56 for one all-roles process, plus
    /// the release controller's one dedicated connection per API process.
    pub db_pool_api: u32,
    /// Pool of the API role's Stripe webhook ingress (its own bulkhead).
    pub db_pool_webhooks: u32,
    /// Pool of the relay role.
    pub db_pool_relay: u32,
    /// Pool of the saga role (≥ consumer_lanes × consumers_per_role + 1).
    pub db_pool_saga: u32,
    /// Pool of the payment role (≥ consumer_lanes × consumers_per_role + 1).
    pub db_pool_payments: u32,
    /// Pool of the ticket role (≥ consumer_lanes × consumers_per_role + 1).
    pub db_pool_tickets: u32,
    /// Pool of the expiry role.
    pub db_pool_expiry: u32,
    /// How long a request waits for a connection before answering 503, ms.
    pub db_acquire_timeout_ms: u64,
    /// Kafka bootstrap servers; unset means "none configured" (the onsale drill then starts an
    /// embedded broker; `serve` refuses roles that need one).
    pub kafka_brokers: Option<String>,
    /// Prefix of every topic and consumer group name.
    pub kafka_topic_prefix: String,
    /// Partitions of every topic. Design §12: `partitions ≥ max(peak topic bytes/s ÷ tested
    /// bytes/s per partition, parallel consumer members)`. Here a purchase event is ~0.5 KB
    /// and an order emits ~9 events, so even 1,000 orders/s is ~4.5 MB/s — far below one
    /// partition's tested rate — and the consumer term decides: members across every process
    /// of the busiest consumer role (`consumers_per_role` × processes). Partitions cannot be
    /// lowered later and ordering is per order id, so size for the largest planned scale-out.
    pub kafka_partitions: i32,
    /// Replication factor of created topics.
    pub kafka_replication: i32,
    /// Members per consumer group in one process (each takes a share of the partitions).
    pub consumers_per_role: usize,
    /// Concurrent lanes per member: messages are spread over lanes by order id, so one
    /// order's events stay ordered while different orders are applied in parallel. Each
    /// busy lane holds one database connection.
    pub consumer_lanes: usize,
    /// Attempts of a transiently failing message in place before it moves to the 5 s retry
    /// topic (design §8).
    pub consumer_inline_attempts: u32,
    /// Delay of `ticketing.purchase.retry-5s.v1`, ms.
    pub consumer_retry_5s_delay_ms: u64,
    /// Delay of `ticketing.purchase.retry-1m.v1`, ms.
    pub consumer_retry_1m_delay_ms: u64,
    /// Attempts in all before a message is dead-lettered (default 8: about 5 minutes).
    pub consumer_max_attempts: u32,
    /// HTTP listen address of the API role.
    pub http_bind: String,
    /// Longest wait for a request's head (request line and headers), ms, counted from the
    /// connection's start or the previous response on a kept-alive connection: a client
    /// that sends half a request and stops, or idles, is disconnected after it (default
    /// 5000).
    pub http_header_read_timeout_ms: u64,
    /// Longest time one request may take, body included, ms; past it the answer is 503
    /// `request_timeout` with `Retry-After` and the handler is dropped (default 15000).
    pub http_request_timeout_ms: u64,
    /// Longest pause between two chunks of a request body, ms; past it the answer is 408
    /// `request_body_timeout` (default 5000).
    pub http_request_body_timeout_ms: u64,
    /// Requests in flight at once per API process; one more is answered 503 `overloaded`
    /// with `Retry-After` at once instead of queueing (default 512).
    pub http_max_concurrent_requests: usize,
    /// Open connections per API process served normally; beyond it a connection gets one
    /// 503 `overloaded` and is closed, and beyond another eighth it is closed at once
    /// (default 4096; keep it below the process's file-descriptor limit).
    pub http_max_connections: usize,
    /// This deployment's purchase cell (bound into admission tokens).
    pub purchase_cell: String,
    /// HMAC secret verifying buyers' bearer JWTs (dev default; the identity provider's key in
    /// production).
    #[serde(serialize_with = "redact")]
    pub user_jwt_secret: SecretString,
    /// `kid` of the admission-token signing key (placed in every token header).
    pub admission_kid: String,
    /// Ed25519 private key signing admission tokens: PKCS#8 PEM (`-----BEGIN PRIVATE KEY-----`,
    /// `openssl genpkey -algorithm ed25519`) or a path to such a file. The default is the
    /// public development key (`AdmissionSigningKey::dev`, kid `dev-ed25519-1`): replace both
    /// in production.
    #[serde(serialize_with = "redact")]
    pub admission_private_key: SecretString,
    /// Further verification keys (rotation): a token is accepted when its `kid` is the signing
    /// key's or one of these. Rotate by listing the new key here everywhere, then making it
    /// the signing key and listing the old one here until `admission_ttl_s` has passed.
    pub admission_public_keys: Vec<AdmissionPublicKey>,
    /// Serve `POST /events/{id}/admission`, which admits at once without the waiting room
    /// (development, tests and the in-process onsale). Off by default: in production every
    /// buyer comes through the queue.
    pub admission_direct: bool,
    /// Admission slot length, seconds: a released ticket may buy for this long, and its
    /// admission token expires at the slot's end.
    pub admission_ttl_s: i64,
    /// Redis of the waiting room, rate buckets and revocation set (may contain a password:
    /// secret). Redis is a shield, not a ledger: when it is down, joins and polls answer 503
    /// and admitted buyers keep buying. One primary per purchase cell (not Redis Cluster).
    #[serde(serialize_with = "redact")]
    pub redis_url: SecretString,
    /// Prefix of every Redis key of this deployment.
    pub redis_key_prefix: String,
    /// Bound of one Redis call, connecting included, ms: a dead Redis becomes a 503 this fast.
    pub redis_timeout_ms: u64,
    /// Highest release rate `R` of the purchase cell, queued positions admitted per second
    /// (split evenly among the events with a queue). The release controller (design §3, see
    /// `boxoffice_workers::release`) runs in every API process, but only the holder of the
    /// cell's PostgreSQL advisory lock releases. 0 turns the controller off (release by hand
    /// with `boxoffice waitroom release`).
    pub release_max_per_s: f64,
    /// Lowest `R`, positions/s (> 0: the queue always moves, however slowly).
    pub release_min_per_s: f64,
    /// `R` when a controller takes the lock, positions/s (within min..=max).
    pub release_initial_per_s: f64,
    /// Additive increase of `R` per tick with every signal healthy, positions/s.
    pub release_step_per_s: f64,
    /// Multiplicative decrease of `R` per tick with a signal over its threshold (0 < f < 1).
    pub release_decrease_factor: f64,
    /// A signal above this fraction of its threshold holds `R` steady (0 < f ≤ 1; 1 = no
    /// hold zone). This is what lowers the pressure before a threshold is crossed.
    pub release_soft_fraction: f64,
    /// Tick of the release controller (sample, decide, release), ms.
    pub release_tick_ms: u64,
    /// Bound of each signal probe, ms; a probe past it has failed (counts as over).
    pub release_probe_timeout_ms: u64,
    /// Threshold: commit latency of the probe transaction, ms.
    pub release_threshold_pg_commit_ms: f64,
    /// Threshold: sessions of the database waiting on a lock.
    pub release_threshold_lock_waits: f64,
    /// Threshold: deadlocks per tick (0 = any deadlock lowers `R`).
    pub release_threshold_deadlocks: f64,
    /// Threshold: client connections / `max_connections` of the whole server (0..=1),
    /// whichever database they use — the server refuses new connections at 1, whoever holds
    /// them. The default 0.9 puts the hold zone (× `release_soft_fraction`) at 0.72, above one
    /// all-roles process's budget plus operations (65 of the default 100).
    pub release_threshold_connection_saturation: f64,
    /// Threshold: age of the oldest unpublished outbox row, ms.
    pub release_threshold_outbox_age_ms: f64,
    /// Threshold: consumer lag of the purchase topic's consumer groups, messages (read only
    /// when a broker is configured).
    pub release_threshold_consumer_lag: f64,
    /// Threshold: active holds.
    pub release_threshold_active_holds: f64,
    /// Threshold: how far the oldest active hold is past its expiry, ms.
    pub release_threshold_expiry_delay_ms: f64,
    /// A queue position whose holder has not polled for this long lapses, ms.
    pub waitroom_abandon_after_ms: u64,
    /// Poll interval suggested to queued clients (`poll_after_ms`), ms; keep it well below
    /// `waitroom_abandon_after_ms`.
    pub waitroom_poll_interval_ms: u64,
    /// Live queue positions one user may hold across all events (one per event at most).
    pub waitroom_max_positions_per_user: u32,
    /// Waiting-room requests per second per client IP (0 = no per-IP bucket). Every buyer
    /// route class has its own buckets (`rate_limit_purchase_*`, `rate_limit_seats_*`); see
    /// `boxoffice_api::limits` for what happens when Redis is down.
    pub rate_limit_ip_per_s: f64,
    /// Burst of the per-IP bucket, requests.
    pub rate_limit_ip_burst: u32,
    /// Waiting-room requests per second per authenticated user (0 = no per-user bucket).
    pub rate_limit_user_per_s: f64,
    /// Burst of the per-user bucket, requests.
    pub rate_limit_user_burst: u32,
    /// Purchase-route requests (admission, holds, order status) per second per client IP
    /// (0 = no per-IP bucket on them; default 50).
    pub rate_limit_purchase_ip_per_s: f64,
    /// Burst of the purchase routes' per-IP bucket, requests (default 100).
    pub rate_limit_purchase_ip_burst: u32,
    /// Purchase-route requests per second per authenticated user (0 = none; default 10).
    pub rate_limit_purchase_user_per_s: f64,
    /// Burst of the purchase routes' per-user bucket, requests (default 20).
    pub rate_limit_purchase_user_burst: u32,
    /// Seat-map requests per second per client IP (0 = none; default 10). Unauthenticated,
    /// so there is no per-user bucket.
    pub rate_limit_seats_ip_per_s: f64,
    /// Burst of the seat map's per-IP bucket, requests (default 20).
    pub rate_limit_seats_ip_burst: u32,
    /// Proxies of this deployment in front of the API, each appending the address it saw to
    /// `X-Forwarded-For`: the rate buckets count a request against the entry this many
    /// places from the right (what the outermost trusted proxy saw). 0 (the default) ignores
    /// the header and counts the socket's peer; set it only behind proxies that append.
    pub http_trusted_proxy_hops: u32,
    /// Replaced by `http_trusted_proxy_hops` (`true` was 1 hop); refused when set, so a
    /// deployment that trusted its proxy does not silently count every buyer as the proxy.
    #[serde(default, skip_serializing)]
    pub http_trust_forwarded_for: Option<bool>,
    /// Hold time to live, ms (default 5 minutes).
    pub hold_ttl_ms: u64,
    /// Stripe API base URL: `https://api.stripe.com` in production, the simulator otherwise.
    /// Empty means "no provider configured": `audit` then skips its provider checks and
    /// `reconcile` refuses to run.
    pub stripe_api_base: String,
    /// Stripe secret key (`sk_…`).
    #[serde(serialize_with = "redact")]
    pub stripe_secret_key: SecretString,
    /// Stripe publishable key (`pk_…`), used by simulated buyers only.
    pub stripe_publishable_key: String,
    /// Stripe webhook endpoint secret (`whsec_…`).
    #[serde(serialize_with = "redact")]
    pub stripe_webhook_secret: SecretString,
    /// Timeout of one Stripe call, ms.
    pub stripe_timeout_ms: u64,
    /// Outbox rows per relay batch.
    pub relay_batch: i64,
    /// Relay lease on claimed rows, ms (must exceed the producer's 30 s delivery timeout).
    pub relay_lease_ms: i64,
    /// Published outbox rows are deleted after this many seconds.
    pub outbox_retention_s: i64,
    /// Holds expired per expiry transaction.
    pub expiry_batch: i64,
    /// Expiry sweep interval when idle, ms.
    pub expiry_interval_ms: u64,
    /// Confirmed orders still uncaptured this many seconds before Stripe's capture deadline
    /// are released and their authorization cancelled on purpose (case C09).
    pub capture_deadline_margin_s: i64,
    /// Inbox rows are pruned after this many seconds; keep it above the topics' retention.
    pub inbox_retention_s: i64,
    /// Log format: `text` or `json`.
    pub log_format: String,
    /// Fault points to arm at start-up (`BOXOFFICE_FAULTS`), `point=actions;…` in the
    /// `fail` crate's syntax, e.g. `payments.after_remote=5%return(abort)`. Empty (the
    /// default) leaves every point inert; see `boxoffice_faults` for the points and modes.
    pub faults: String,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            database_url: "postgres://postgres@127.0.0.1:5432/boxoffice".into(),
            db_max_connections: 8,
            db_pool_api: 20,
            db_pool_webhooks: 4,
            db_pool_relay: 3,
            db_pool_saga: 9,
            db_pool_payments: 9,
            db_pool_tickets: 9,
            db_pool_expiry: 2,
            db_acquire_timeout_ms: 3_000,
            kafka_brokers: None,
            kafka_topic_prefix: String::new(),
            kafka_partitions: 12,
            kafka_replication: 1,
            consumers_per_role: 1,
            consumer_lanes: 8,
            consumer_inline_attempts: 3,
            consumer_retry_5s_delay_ms: 5_000,
            consumer_retry_1m_delay_ms: 60_000,
            consumer_max_attempts: 8,
            http_bind: "127.0.0.1:8080".into(),
            http_header_read_timeout_ms: 5_000,
            http_request_timeout_ms: 15_000,
            http_request_body_timeout_ms: 5_000,
            http_max_concurrent_requests: 512,
            http_max_connections: 4_096,
            purchase_cell: "cell-1".into(),
            user_jwt_secret: "dev-user-secret-change-me-0123456789".into(),
            admission_kid: boxoffice_admission::DEV_KID.into(),
            admission_private_key: AdmissionSigningKey::dev().to_pkcs8_pem().into(),
            admission_public_keys: Vec::new(),
            admission_direct: false,
            admission_ttl_s: 900,
            redis_url: "redis://127.0.0.1:6379".into(),
            redis_key_prefix: "boxoffice:".into(),
            redis_timeout_ms: 300,
            release_max_per_s: 50.0,
            release_min_per_s: 1.0,
            release_initial_per_s: 10.0,
            release_step_per_s: 5.0,
            release_decrease_factor: 0.5,
            release_soft_fraction: 0.8,
            release_tick_ms: 1_000,
            release_probe_timeout_ms: 2_000,
            release_threshold_pg_commit_ms: 50.0,
            release_threshold_lock_waits: 10.0,
            release_threshold_deadlocks: 0.0,
            release_threshold_connection_saturation: 0.9,
            release_threshold_outbox_age_ms: 5_000.0,
            release_threshold_consumer_lag: 5_000.0,
            release_threshold_active_holds: 50_000.0,
            release_threshold_expiry_delay_ms: 10_000.0,
            waitroom_abandon_after_ms: 30_000,
            waitroom_poll_interval_ms: 2_000,
            waitroom_max_positions_per_user: 2,
            rate_limit_ip_per_s: 20.0,
            rate_limit_ip_burst: 40,
            rate_limit_user_per_s: 2.0,
            rate_limit_user_burst: 10,
            rate_limit_purchase_ip_per_s: 50.0,
            rate_limit_purchase_ip_burst: 100,
            rate_limit_purchase_user_per_s: 10.0,
            rate_limit_purchase_user_burst: 20,
            rate_limit_seats_ip_per_s: 10.0,
            rate_limit_seats_ip_burst: 20,
            http_trusted_proxy_hops: 0,
            http_trust_forwarded_for: None,
            hold_ttl_ms: 300_000,
            stripe_api_base: "https://api.stripe.com".into(),
            stripe_secret_key: "sk_test_boxoffice_dev".into(),
            stripe_publishable_key: "pk_test_boxoffice_dev".into(),
            stripe_webhook_secret: "whsec_boxoffice_dev".into(),
            stripe_timeout_ms: 10_000,
            relay_batch: 500,
            relay_lease_ms: 45_000,
            outbox_retention_s: 3_600,
            expiry_batch: 500,
            expiry_interval_ms: 250,
            capture_deadline_margin_s: 86_400,
            inbox_retention_s: 7 * 86_400,
            log_format: "text".into(),
            faults: String::new(),
        }
    }
}

impl Config {
    /// Defaults → `file` (if any) → `BOXOFFICE_*` environment, then [`Config::validate`].
    pub fn load(file: Option<&Path>) -> anyhow::Result<Self> {
        let mut fig = Figment::from(Serialized::defaults(Config::default()));
        // Serialized defaults carry "[redacted]" for secrets: put the real defaults back.
        let d = Config::default();
        fig = fig
            .merge(Serialized::default("database_url", d.database_url.expose_secret()))
            .merge(Serialized::default("user_jwt_secret", d.user_jwt_secret.expose_secret()))
            .merge(Serialized::default("stripe_secret_key", d.stripe_secret_key.expose_secret()))
            .merge(Serialized::default("stripe_webhook_secret", d.stripe_webhook_secret.expose_secret()))
            .merge(Serialized::default("admission_private_key", d.admission_private_key.expose_secret()))
            .merge(Serialized::default("redis_url", d.redis_url.expose_secret()));
        if let Some(f) = file {
            fig = fig.merge(Toml::file_exact(f));
        }
        let cfg: Config =
            fig.merge(Env::prefixed("BOXOFFICE_")).extract().context("invalid configuration")?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks ranges and required secrets.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.hold_ttl_ms < 1_000 {
            bail!("hold_ttl_ms must be at least 1000");
        }
        if self.kafka_partitions < 1 || self.kafka_replication < 1 {
            bail!("kafka_partitions and kafka_replication must be at least 1");
        }
        if self.consumer_lanes < 1 || self.consumer_lanes > 256 || self.consumers_per_role < 1 {
            bail!("consumer_lanes must be 1..=256 and consumers_per_role at least 1");
        }
        if self.consumer_inline_attempts < 1 || self.consumer_max_attempts <= self.consumer_inline_attempts {
            bail!("consumer_inline_attempts must be at least 1 and below consumer_max_attempts");
        }
        let pools = [
            self.db_max_connections,
            self.db_pool_api,
            self.db_pool_webhooks,
            self.db_pool_relay,
            self.db_pool_saga,
            self.db_pool_payments,
            self.db_pool_tickets,
            self.db_pool_expiry,
        ];
        if pools.iter().any(|p| *p < 1) {
            bail!("every db pool needs at least one connection");
        }
        self.admission_tokens().context("invalid admission keys")?;
        if self.admission_ttl_s < 1 {
            bail!("admission_ttl_s must be at least 1");
        }
        if !(50..=10_000).contains(&self.redis_timeout_ms) {
            bail!("redis_timeout_ms must be 50..=10000");
        }
        if self.waitroom_poll_interval_ms < 100
            || self.waitroom_poll_interval_ms * 2 > self.waitroom_abandon_after_ms
        {
            bail!("waitroom_poll_interval_ms must be at least 100 and at most half of waitroom_abandon_after_ms");
        }
        if self.waitroom_max_positions_per_user < 1 {
            bail!("waitroom_max_positions_per_user must be at least 1");
        }
        let rates = [
            self.release_max_per_s,
            self.rate_limit_ip_per_s,
            self.rate_limit_user_per_s,
            self.rate_limit_purchase_ip_per_s,
            self.rate_limit_purchase_user_per_s,
            self.rate_limit_seats_ip_per_s,
        ];
        if rates.iter().any(|r| !r.is_finite() || *r < 0.0) {
            bail!("release_max_per_s and rate_limit_*_per_s must be finite and >= 0");
        }
        if self.release_max_per_s > 0.0 {
            self.validate_release()?;
        }
        let bursts = [
            self.rate_limit_ip_burst,
            self.rate_limit_user_burst,
            self.rate_limit_purchase_ip_burst,
            self.rate_limit_purchase_user_burst,
            self.rate_limit_seats_ip_burst,
        ];
        if bursts.iter().any(|b| *b < 1) {
            bail!("rate_limit_*_burst must be at least 1");
        }
        self.validate_http()?;
        if self.user_jwt_secret.expose_secret().len() < 16 {
            bail!("user_jwt_secret must be 16+ bytes");
        }
        if self.stripe_webhook_secret.expose_secret().is_empty()
            || self.stripe_secret_key.expose_secret().is_empty()
        {
            bail!("stripe_secret_key and stripe_webhook_secret are required");
        }
        if self.relay_lease_ms <= 30_000 {
            bail!("relay_lease_ms must exceed the producer's 30 s delivery timeout");
        }
        if !matches!(self.log_format.as_str(), "text" | "json") {
            bail!("log_format must be text or json");
        }
        boxoffice_faults::validate(&self.faults).map_err(|e| anyhow::anyhow!("faults: {e}"))?;
        Ok(())
    }

    /// Checks the HTTP edge's bounds.
    fn validate_http(&self) -> anyhow::Result<()> {
        let timeouts = [
            ("http_header_read_timeout_ms", self.http_header_read_timeout_ms),
            ("http_request_timeout_ms", self.http_request_timeout_ms),
            ("http_request_body_timeout_ms", self.http_request_body_timeout_ms),
        ];
        for (name, ms) in timeouts {
            if !(100..=600_000).contains(&ms) {
                bail!("{name} must be 100..=600000");
            }
        }
        if self.http_max_concurrent_requests < 1 || self.http_max_connections < 1 {
            bail!("http_max_concurrent_requests and http_max_connections must be at least 1");
        }
        if self.http_trust_forwarded_for.is_some() {
            bail!("http_trust_forwarded_for was replaced by http_trusted_proxy_hops (true = 1 hop)");
        }
        if self.http_trusted_proxy_hops > 16 {
            bail!("http_trusted_proxy_hops must be 0..=16");
        }
        Ok(())
    }

    /// The HTTP edge's bounds.
    pub fn edge(&self) -> boxoffice_api::EdgeSettings {
        use std::time::Duration;
        boxoffice_api::EdgeSettings {
            header_read_timeout: Duration::from_millis(self.http_header_read_timeout_ms),
            request_timeout: Duration::from_millis(self.http_request_timeout_ms),
            body_read_timeout: Duration::from_millis(self.http_request_body_timeout_ms),
            max_concurrent_requests: self.http_max_concurrent_requests,
            max_connections: self.http_max_connections,
        }
    }

    /// The rate buckets of every buyer route class.
    pub fn rate_limits(&self) -> boxoffice_api::limits::RateLimits {
        use boxoffice_api::limits::{RateLimits, RouteBuckets};
        let bucket =
            |per_s: f64, burst: u32| (per_s > 0.0).then_some(boxoffice_waitroom::Bucket { per_s, burst });
        RateLimits {
            queue: RouteBuckets {
                ip: bucket(self.rate_limit_ip_per_s, self.rate_limit_ip_burst),
                user: bucket(self.rate_limit_user_per_s, self.rate_limit_user_burst),
            },
            purchase: RouteBuckets {
                ip: bucket(self.rate_limit_purchase_ip_per_s, self.rate_limit_purchase_ip_burst),
                user: bucket(self.rate_limit_purchase_user_per_s, self.rate_limit_purchase_user_burst),
            },
            seats: RouteBuckets {
                ip: bucket(self.rate_limit_seats_ip_per_s, self.rate_limit_seats_ip_burst),
                user: None,
            },
        }
    }

    /// Checks the release controller's settings (when it is on).
    fn validate_release(&self) -> anyhow::Result<()> {
        let (min, init, max) = (self.release_min_per_s, self.release_initial_per_s, self.release_max_per_s);
        if !(min.is_finite() && init.is_finite() && min > 0.0 && min <= init && init <= max) {
            bail!("release rates must satisfy 0 < release_min_per_s <= release_initial_per_s <= release_max_per_s");
        }
        if !(self.release_step_per_s.is_finite() && self.release_step_per_s > 0.0) {
            bail!("release_step_per_s must be > 0");
        }
        if !(self.release_decrease_factor > 0.0 && self.release_decrease_factor < 1.0) {
            bail!("release_decrease_factor must be in (0, 1)");
        }
        if !(self.release_soft_fraction > 0.0 && self.release_soft_fraction <= 1.0) {
            bail!("release_soft_fraction must be in (0, 1]");
        }
        if !(50..=60_000).contains(&self.release_tick_ms) {
            bail!("release_tick_ms must be 50..=60000");
        }
        if !(10..=60_000).contains(&self.release_probe_timeout_ms) {
            bail!("release_probe_timeout_ms must be 10..=60000");
        }
        let t = self.release_thresholds();
        for s in boxoffice_workers::release::Signal::ALL {
            let v = t.of(s);
            if !v.is_finite() || v < 0.0 {
                bail!("release_threshold_{} must be finite and >= 0", s.name());
            }
        }
        Ok(())
    }

    /// The release controller's thresholds.
    pub fn release_thresholds(&self) -> boxoffice_workers::release::Thresholds {
        boxoffice_workers::release::Thresholds {
            pg_commit_ms: self.release_threshold_pg_commit_ms,
            lock_waits: self.release_threshold_lock_waits,
            deadlocks: self.release_threshold_deadlocks,
            connection_saturation: self.release_threshold_connection_saturation,
            outbox_age_ms: self.release_threshold_outbox_age_ms,
            consumer_lag: self.release_threshold_consumer_lag,
            active_holds: self.release_threshold_active_holds,
            expiry_delay_ms: self.release_threshold_expiry_delay_ms,
        }
    }

    /// The release controller's settings (cell, rates, gains, thresholds, tick).
    pub fn release(&self) -> boxoffice_workers::release::ReleaseSettings {
        boxoffice_workers::release::ReleaseSettings {
            cell: self.purchase_cell.clone(),
            initial_per_s: self.release_initial_per_s,
            limits: boxoffice_workers::release::Limits {
                min_per_s: self.release_min_per_s,
                max_per_s: self.release_max_per_s,
                step_per_s: self.release_step_per_s,
                decrease_factor: self.release_decrease_factor,
                soft_fraction: self.release_soft_fraction,
            },
            thresholds: self.release_thresholds(),
            tick_ms: self.release_tick_ms,
            probe_timeout_ms: self.release_probe_timeout_ms,
        }
    }

    /// The Kafka settings, if a broker is configured.
    pub fn kafka(&self) -> Option<boxoffice_bus::KafkaConfig> {
        self.kafka_brokers.as_ref().map(|b| boxoffice_bus::KafkaConfig {
            brokers: b.clone(),
            prefix: self.kafka_topic_prefix.clone(),
            partitions: self.kafka_partitions,
            replication: self.kafka_replication,
            retry: boxoffice_bus::RetryPolicy {
                inline_attempts: self.consumer_inline_attempts,
                retry_5s_delay_ms: self.consumer_retry_5s_delay_ms,
                retry_1m_delay_ms: self.consumer_retry_1m_delay_ms,
                max_attempts: self.consumer_max_attempts,
            },
        })
    }

    /// The admission-token key ring: the signing key (`admission_kid`,
    /// `admission_private_key`) and the extra verification keys, read from PEM strings or
    /// files.
    pub fn admission_tokens(&self) -> anyhow::Result<AdmissionTokens> {
        let private = pem_or_file(self.admission_private_key.expose_secret(), "admission_private_key")?;
        let signing = AdmissionSigningKey::from_pem(&self.admission_kid, &private)?;
        let verifying = self
            .admission_public_keys
            .iter()
            .map(|k| {
                let pem = pem_or_file(&k.public_key, &format!("admission_public_keys[{}]", k.kid))?;
                Ok(AdmissionVerifyingKey::from_pem(&k.kid, &pem)?)
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(AdmissionTokens::new(&signing, &verifying, &self.purchase_cell)?)
    }

    /// The waiting room's settings.
    pub fn waitroom(&self) -> boxoffice_waitroom::WaitroomConfig {
        boxoffice_waitroom::WaitroomConfig {
            redis_url: self.redis_url.expose_secret().to_owned(),
            key_prefix: self.redis_key_prefix.clone(),
            timeout_ms: self.redis_timeout_ms,
            abandon_after_ms: self.waitroom_abandon_after_ms,
            slot_ms: self.admission_ttl_s as u64 * 1_000,
            max_positions_per_user: self.waitroom_max_positions_per_user,
            ..Default::default()
        }
    }

    /// The Stripe client settings, if a provider is configured (`stripe_api_base` not empty).
    pub fn stripe(&self) -> Option<boxoffice_payments::StripeConfig> {
        (!self.stripe_api_base.trim().is_empty()).then(|| boxoffice_payments::StripeConfig {
            api_base: self.stripe_api_base.clone(),
            secret_key: self.stripe_secret_key.clone(),
            timeout_ms: self.stripe_timeout_ms,
        })
    }

    /// The PostgreSQL connect options.
    pub fn pg_options(&self) -> anyhow::Result<sqlx::postgres::PgConnectOptions> {
        self.database_url.expose_secret().parse().context("invalid database_url")
    }
}

/// A PEM value as given, or the contents of the file it names. Errors name the setting and
/// the path, never the contents.
fn pem_or_file(value: &str, setting: &str) -> anyhow::Result<String> {
    if value.trim_start().starts_with("-----BEGIN") {
        return Ok(value.to_owned());
    }
    std::fs::read_to_string(value.trim())
        .with_context(|| format!("{setting}: reading the key file {:?}", value.trim()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_debug_redacts_secrets() {
        let c = Config::default();
        c.validate().unwrap();
        let dbg = format!("{c:?}");
        assert!(!dbg.contains("whsec_boxoffice_dev"));
        assert!(!dbg.contains("dev-user-secret"));
        assert!(!dbg.contains("PRIVATE KEY"));
        assert!(!dbg.contains("redis://"));
    }

    #[test]
    fn admission_keys_load_from_pem_or_files_and_rotate() {
        let dir = std::env::temp_dir().join(format!("boxoffice-keys-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let new = AdmissionSigningKey::from_seed("k2", [2; 32]);
        let old = AdmissionSigningKey::from_seed("k1", [1; 32]);
        let key_file = dir.join("k2.pem");
        std::fs::write(&key_file, new.to_pkcs8_pem()).unwrap();
        let c = Config {
            admission_kid: "k2".into(),
            admission_private_key: key_file.display().to_string().into(),
            admission_public_keys: vec![AdmissionPublicKey {
                kid: "k1".into(),
                public_key: old.verifying_key().to_pem(),
            }],
            ..Config::default()
        };
        c.validate().unwrap();
        let ring = c.admission_tokens().unwrap();
        assert_eq!(ring.signing_kid(), "k2");
        assert_eq!(ring.verification_kids(), ["k1", "k2"]);
        let missing =
            Config { admission_private_key: dir.join("nope.pem").display().to_string().into(), ..c.clone() };
        assert!(missing.validate().is_err());
        let conflict = Config {
            admission_public_keys: vec![AdmissionPublicKey {
                kid: "k2".into(),
                public_key: old.verifying_key().to_pem(),
            }],
            ..c
        };
        assert!(conflict.validate().is_err(), "two keys under one kid");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn release_settings_are_validated() {
        let ok = Config::default();
        assert_eq!(ok.release().limits.max_per_s, 50.0);
        let bad = [
            Config { release_min_per_s: 0.0, ..Config::default() },
            Config { release_initial_per_s: 60.0, ..Config::default() },
            Config { release_decrease_factor: 1.0, ..Config::default() },
            Config { release_step_per_s: 0.0, ..Config::default() },
            Config { release_soft_fraction: 0.0, ..Config::default() },
            Config { release_tick_ms: 10, ..Config::default() },
            Config { release_threshold_outbox_age_ms: -1.0, ..Config::default() },
            Config { release_threshold_pg_commit_ms: f64::NAN, ..Config::default() },
            Config { release_max_per_s: -1.0, ..Config::default() },
        ];
        for c in bad {
            assert!(c.validate().is_err(), "{c:?}");
        }
        // Off: the other release settings are not looked at.
        Config { release_max_per_s: 0.0, release_min_per_s: 0.0, ..Config::default() }.validate().unwrap();
    }

    #[test]
    fn edge_settings_are_validated_and_mapped() {
        let c = Config::default();
        let edge = c.edge();
        assert_eq!(edge.header_read_timeout, std::time::Duration::from_secs(5));
        assert_eq!((edge.max_concurrent_requests, edge.max_connections), (512, 4_096));
        let limits = c.rate_limits();
        assert!(limits.purchase.ip.is_some() && limits.purchase.user.is_some() && limits.seats.ip.is_some());
        let off = Config { rate_limit_seats_ip_per_s: 0.0, ..Config::default() }.rate_limits();
        assert!(off.seats.ip.is_none(), "0 turns a bucket off");
        let bad = [
            Config { http_header_read_timeout_ms: 0, ..Config::default() },
            Config { http_request_timeout_ms: 10_000_000, ..Config::default() },
            Config { http_request_body_timeout_ms: 10, ..Config::default() },
            Config { http_max_concurrent_requests: 0, ..Config::default() },
            Config { http_max_connections: 0, ..Config::default() },
            Config { http_trusted_proxy_hops: 100, ..Config::default() },
            Config { http_trust_forwarded_for: Some(true), ..Config::default() },
            Config { rate_limit_purchase_user_per_s: -1.0, ..Config::default() },
            Config { rate_limit_seats_ip_burst: 0, ..Config::default() },
        ];
        for c in bad {
            assert!(c.validate().is_err(), "{c:?}");
        }
    }

    #[test]
    fn load_applies_defaults() {
        let c = Config::load(None).unwrap();
        assert_eq!(c.stripe_webhook_secret.expose_secret(), "whsec_boxoffice_dev");
        assert_eq!(c.kafka_partitions, 12);
    }
}
