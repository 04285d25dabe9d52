//! The one typed configuration of every role, loaded once at start-up: defaults (documented
//! on each field) → an optional TOML file (`--config` / `BOXOFFICE_CONFIG`) → `BOXOFFICE_*`
//! environment variables (e.g. `BOXOFFICE_DATABASE_URL`, `BOXOFFICE_KAFKA_BROKERS`,
//! `BOXOFFICE_HOLD_TTL_MS`). Validated before anything starts; secrets are
//! [`secrecy::SecretString`] and never printed (`Debug` redacts them).
//!
//! The defaults are a development configuration: their secrets (user-token secret, admission
//! key, Stripe keys) are public in this repository. [`Config::env`] says which rules apply:
//! in [`Environment::Production`] (the product binary's default) [`Config::validate`]
//! refuses a built-in development secret, a secret shorter than its minimum, a test key or
//! development webhook secret against Stripe's live API, buyer tokens not verified with an
//! identity provider's keys, the waiting-room bypass `admission_direct`, and SASL PLAIN in
//! the clear — naming every offending key at
//! once ([`SecretFindings`]), never a value. In [`Environment::Development`] (the drills and
//! the tests) the same findings are warnings ([`Config::development_warnings`], logged by
//! `serve`). A live Stripe key is refused in development, and wherever it would be sent to
//! a base other than `api.stripe.com`.

use anyhow::{bail, Context};
use boxoffice_admission::{AdmissionSigningKey, AdmissionTokens, AdmissionVerifyingKey};
use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The settings that are secrets ([`SecretString`]): read from `BOXOFFICE_*` verbatim, never
/// parsed as numbers or booleans, never echoed in an error.
pub const SECRET_KEYS: [&str; 11] = [
    "database_url",
    "control_database_url",
    "witness_database_url",
    "region_peer_database_url",
    "kafka_sasl_password",
    "user_jwt_secret",
    "admission_private_key",
    "redis_url",
    "stripe_secret_key",
    "stripe_webhook_secret",
    "admin_token",
];

/// Which rules the configuration is held to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Environment {
    /// Built-in development secrets allowed (each one warned about by `serve`), HS256 buyer
    /// tokens accepted. The drills, the tests and local runs.
    #[serde(alias = "dev")]
    Development,
    /// Real money: every secret set and strong, buyer tokens only from the identity provider.
    #[serde(alias = "prod")]
    Production,
}

impl Environment {
    /// The value of `env` / `BOXOFFICE_ENV`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Development => "development",
            Self::Production => "production",
        }
    }
}

/// The built-in development HS256 user-token secret (public).
pub const DEV_USER_JWT_SECRET: &str = "dev-user-secret-change-me-0123456789";
/// The built-in development Stripe secret key (public).
pub const DEV_STRIPE_SECRET_KEY: &str = "sk_test_boxoffice_dev";
/// The built-in development webhook secrets (public): the configuration's and the simulator's.
pub const DEV_WEBHOOK_SECRETS: [&str; 2] = ["whsec_boxoffice_dev", "whsec_boxoffice_sim"];
/// Shortest HS256 user-token secret, bytes (a key as long as the hash: RFC 7518 §3.2).
pub const MIN_USER_JWT_SECRET_BYTES: usize = 32;
/// Shortest Stripe secret key, characters (`sk_live_` + 24, Stripe's shortest).
pub const MIN_STRIPE_SECRET_KEY_CHARS: usize = 32;
/// Shortest Stripe webhook secret, characters (Stripe's are `whsec_` + 32 or more).
pub const MIN_WEBHOOK_SECRET_CHARS: usize = 32;
/// Shortest Kafka SASL password, characters.
pub const MIN_KAFKA_PASSWORD_CHARS: usize = 16;
/// The built-in development operator token of the `/admin` routes (public).
pub const DEV_ADMIN_TOKEN: &str = "dev-admin-token-change-me-0123456789";
/// Shortest operator token, characters (e.g. `openssl rand -hex 32` gives 64).
pub const MIN_ADMIN_TOKEN_CHARS: usize = 32;

/// The shortest `inbox_retention_s` accepted, seconds (one day): a consumer's inbox row must
/// outlive every redelivery of its message, and a broker keeps a topic's messages for days.
pub const MIN_INBOX_RETENTION_S: i64 = 86_400;

/// The longest retention of the inbox and of webhook events accepted, seconds (ten years): a
/// longer one puts the prune's bound out of PostgreSQL's timestamp range.
pub const MAX_RETENTION_S: i64 = 3_650 * 86_400;

/// How a [`SecretFinding`] weighs in each environment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Severity {
    /// A warning in development, a refusal in production.
    Development,
    /// Silent in development, a refusal in production.
    ProductionOnly,
    /// A refusal in every environment.
    Always,
}

/// One problem with one setting. Names the setting, never its value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SecretFinding {
    /// The setting's key (in the file; `BOXOFFICE_` + upper case in the environment).
    pub key: &'static str,
    /// What is wrong.
    pub problem: String,
    /// Where it is refused.
    pub severity: Severity,
}

/// The refusal of a configuration: every offending setting, one line each.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", render_refusal(*env, findings))]
pub struct SecretFindings {
    /// The environment the configuration was checked for.
    pub env: Environment,
    /// The findings that refuse it (grouped by key in the message).
    pub findings: Vec<SecretFinding>,
}

impl SecretFindings {
    /// The offending keys, in order, each once.
    pub fn keys(&self) -> Vec<&'static str> {
        let mut keys: Vec<&'static str> = Vec::new();
        for f in &self.findings {
            if !keys.contains(&f.key) {
                keys.push(f.key);
            }
        }
        keys
    }
}

/// One line per key, its problems joined.
fn by_key(findings: &[SecretFinding]) -> Vec<(&'static str, String)> {
    let mut out: Vec<(&'static str, String)> = Vec::new();
    for f in findings {
        match out.iter_mut().find(|(k, _)| *k == f.key) {
            Some((_, p)) => {
                p.push_str("; ");
                p.push_str(&f.problem);
            }
            None => out.push((f.key, f.problem.clone())),
        }
    }
    out
}

fn render_refusal(env: Environment, findings: &[SecretFinding]) -> String {
    let lines = by_key(findings);
    let mut s = format!(
        "refusing to start in {}: {} setting{} must change (no secret is printed)",
        env.as_str(),
        lines.len(),
        if lines.len() == 1 { "" } else { "s" }
    );
    for (key, problem) in lines {
        s.push_str(&format!("\n  - {key}: {problem}"));
    }
    if env == Environment::Production {
        s.push_str("\nFor a local run with the built-in development values set BOXOFFICE_ENV=development.");
    }
    s
}

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

fn redact_opt<S: serde::Serializer>(v: &Option<SecretString>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(_) => s.serialize_some("[redacted]"),
        None => s.serialize_none(),
    }
}

/// One purchase cell's connection settings (design §13): its own PostgreSQL writer, topics,
/// consumer groups and Redis keys. `boxoffice --cell NAME …` runs any command against this
/// cell only ([`Config::for_cell`]); the router forwards its events' buyers to `api_url`.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct CellSettings {
    /// The cell's name (`purchase_cell` of its processes; in admission tokens and the
    /// directory).
    pub name: String,
    /// The cell's PostgreSQL URL (secret; its own database, better its own server).
    #[serde(serialize_with = "redact")]
    pub database_url: SecretString,
    /// Prefix of the cell's topics and consumer groups (distinct per cell).
    pub kafka_topic_prefix: String,
    /// Prefix of the cell's Redis keys: waiting room, buckets, revocations (distinct per cell).
    pub redis_key_prefix: String,
    /// Base URL of the cell's API (its load balancer), for the router; e.g.
    /// `http://cell-1.internal:8080`.
    #[serde(default)]
    pub api_url: Option<String>,
}

/// Every setting. Durations are milliseconds unless the name says otherwise.
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct Config {
    /// `development` or `production` (`BOXOFFICE_ENV`; see [`Environment`]). Default:
    /// `production` for the product binary `boxoffice` (every command), `development` for
    /// `boxoffice-drills` and [`Config::default`].
    pub env: Environment,
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
    /// Pool of the relay role: its backlog gauge and pruning, one statement at a time (its
    /// reads and marks go through its own session, the holder of the outbox's lock).
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
    /// `statement_timeout` and `idle_in_transaction_session_timeout` of every session, ms
    /// (default 10000; 0: none, e.g. for a long `migrate`). Bounds how long a write can
    /// still commit after its region's lease lapsed (`region_lease_skew_ms` covers it).
    pub db_statement_timeout_ms: u64,
    /// `plan_cache_mode` of every session: `force_generic_plan` (default), `auto` or
    /// `force_custom_plan`. Every statement boxoffice prepares finds its rows by key or by an
    /// array of keys, with literals wherever a partial index applies, so one generic plan per
    /// session serves each; `auto` plans most of them again at every execution (a custom plan
    /// for each `= ANY($1)`), which cost more PostgreSQL CPU than running them.
    pub db_plan_cache_mode: String,
    /// Kafka bootstrap servers; unset means "none configured" (the onsale drill then starts an
    /// embedded broker; `serve` refuses roles that need one).
    pub kafka_brokers: Option<String>,
    /// Prefix of every topic and consumer group name.
    pub kafka_topic_prefix: String,
    /// librdkafka `security.protocol` of the producer and every consumer: `plaintext`,
    /// `ssl`, `sasl_plaintext` or `sasl_ssl` (unset: plaintext).
    pub kafka_security_protocol: Option<boxoffice_bus::SecurityProtocol>,
    /// `sasl.mechanism`: `PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512` (with a `sasl_*`
    /// protocol; production refuses PLAIN over `sasl_plaintext`).
    pub kafka_sasl_mechanism: Option<boxoffice_bus::SaslMechanism>,
    /// `sasl.username`.
    pub kafka_sasl_username: Option<String>,
    /// `sasl.password` (secret; at least 16 characters in production).
    #[serde(serialize_with = "redact_opt")]
    pub kafka_sasl_password: Option<SecretString>,
    /// `ssl.ca.location`: PEM file of the CAs that sign the brokers' certificates (with
    /// `ssl`/`sasl_ssl`; unset: the system's CAs).
    pub kafka_ssl_ca_location: Option<String>,
    /// Partitions of every topic. Design §12: `partitions ≥ max(peak topic bytes/s ÷ tested
    /// bytes/s per partition, parallel consumer members)`. Here a purchase event is ~0.5 KB
    /// and an order emits ~10 events, so even 1,000 orders/s is ~5 MB/s — far below one
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
    /// busy lane holds one database connection for its transaction; a payment lane's batch
    /// first reads its commands' pre-checks in one statement, and a re-fetch whose intent the
    /// ledger does not record for its order borrows one more for a read.
    pub consumer_lanes: usize,
    /// Most messages a lane of any consumer applies in one transaction (what has queued up
    /// for it, never waiting for more; `boxoffice_bus::consumer`, "Batches"); for the payment
    /// worker also how many Stripe calls a lane makes at once. 1 applies each message in a
    /// transaction of its own. Default 16; 1..=1000. A batch holds the row locks of its orders
    /// until it commits, so a webhook for one of them waits for it.
    pub consumer_batch_max: usize,
    /// Bytes of facts a consumer's fetch waits for at the broker before it answers (librdkafka's
    /// `fetch.min.bytes`), at most `consumer_fetch_wait_ms`: larger makes fewer, larger
    /// fetches and lane batches under load, at up to `consumer_fetch_wait_ms` more per hop
    /// when the bus is quiet. Default 1 (answer as soon as any fact is there); 1..=1048576.
    pub consumer_fetch_min_bytes: u32,
    /// Longest a consumer's fetch waits at the broker, in milliseconds (librdkafka's
    /// `fetch.wait.max.ms`; retry topics always 500). Default 20; 1..=1000.
    pub consumer_fetch_wait_ms: u32,
    /// How long a consumer's lane waits, after the first message of a batch, for more
    /// messages to join the batch before it applies it, in milliseconds (main topic only;
    /// `boxoffice_bus::consumer`, "Batches"): under load, fewer and larger transactions per
    /// fact, at up to this much more per hop (counted from the message's arrival at its lane).
    /// 0: a batch is what has queued up, never waiting. Ignored when `consumer_batch_max` is
    /// 1. Default 0; 0..=100.
    pub consumer_batch_linger_ms: u32,
    /// Most transactions one consumer member's lanes have open at once (main topic only;
    /// `boxoffice_bus::consumer`, "Transaction slots"): a lane waits for a slot after its
    /// provider calls and before its transaction, so the calls of every lane still run at
    /// once while fewer transactions compete for the database (and, under a backlog, with
    /// larger batches). Behind, it carries fewer facts per second than one per lane; and a
    /// transaction waiting on a row lock keeps its slot (up to `db_statement_timeout_ms` per
    /// statement), so with one slot one locked order holds up the member's every lane.
    /// 0: one per lane (no limit). Default 0; 0..=256, and 0 or at most `consumer_lanes`;
    /// only with `consumer_group_commit` false.
    pub consumer_transactions_max: usize,
    /// Whether each consumer member (main topic) commits through one committer that joins
    /// what every lane has ready into one transaction (`boxoffice_bus::consumer`, "Group
    /// commit"): every lane still makes its provider calls at once, and a lane's run of one
    /// message shares the transaction too. Fewer transactions and statements per fact (README,
    /// "Group commit" under Performance); at most `consumer_group_commits_max` transactions
    /// open at once per member, each waiting at most
    /// `boxoffice_bus::consumer::GROUP_LOCK_TIMEOUT_MS` for a row lock. It saves about a
    /// twentieth of the CPU per order at 150 orders/s, but this machine kept up with 150
    /// arrivals/s in a burst with it where each lane's own transactions kept up with 200
    /// (README, "Two open group transactions"). Default false: each lane commits its own,
    /// within `consumer_transactions_max`.
    pub consumer_group_commit: bool,
    /// With `consumer_group_commit`: most group transactions one consumer member (main topic)
    /// has open at once (`boxoffice_bus::consumer`, "Group commit"). 1 makes every commit of
    /// the member wait for the one before (the fewest transactions); each more lets what
    /// arrives meanwhile commit at once, on another connection, in smaller groups (measured
    /// with two: more CPU per order than one, and no larger burst carried; README, "Two open
    /// group transactions"). A member never has more open than it has lanes. Default 1;
    /// 1..=256.
    pub consumer_group_commits_max: usize,
    /// Whether a process that runs the saga or the ticket worker beside another consumer
    /// applies their steps in the transaction that commits the fact they follow
    /// (`boxoffice_bus::follow`): the capture's transaction also moves the order to `paid`
    /// and issues the tickets. Default true; false leaves every step to its consumer on the
    /// bus (one relay hop and one transaction per step).
    pub follow_through: bool,
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
    /// Requests one client address may have in flight at once on the buyer routes; one
    /// more is 429 `too_many_in_flight` before its body is read (default 32; 0 = no limit).
    /// A rate bucket counts requests as they start; this bounds the ones kept open.
    pub http_max_in_flight_per_ip: usize,
    /// The same on `POST /webhooks/stripe` (default 8; 0 = no limit).
    pub webhook_max_in_flight_per_ip: usize,
    /// Waiting-room requests (join, poll, leave together) in flight at once per API process,
    /// a share of `http_max_concurrent_requests` (below it); one more is 503 `overloaded` at
    /// once (default 256).
    /// Each may wait `redis_queue_timeout_ms` for a slow Redis: this keeps the rest of the
    /// process's slots for holds, order status and webhooks.
    pub waitroom_max_concurrent_requests: usize,
    /// Hold requests (`POST /events/{id}/holds`) in flight at once per API process, a share of
    /// `http_max_concurrent_requests` (below it); one more is 503 `overloaded` at once
    /// (default 256). A hold's body is read after its buyer and admission tokens are checked,
    /// so only admitted buyers can hold these slots, but slow ones (a few addresses, each
    /// within `http_max_in_flight_per_ip`) could otherwise take every slot of the process:
    /// this keeps the rest for the seat map, order status, the queue and webhooks.
    pub holds_max_concurrent_requests: usize,
    /// The most Stripe webhook events an API process records in one transaction (default 32;
    /// 1..=1000; 1: one transaction per event). Each connection of `db_pool_webhooks` commits
    /// one batch at a time, gathering the events that arrive while another's transaction is in
    /// flight (`boxoffice_api::webhooks::Ingress`).
    pub webhook_batch_max: usize,
    /// Longest a webhook request may take, body included, ms (default 3000): Stripe sends a
    /// whole small body at once, so a slow sender cannot keep a webhook slot for long.
    pub webhook_timeout_ms: u64,
    /// CIDR networks `POST /webhooks/stripe` accepts requests from, e.g. Stripe's published
    /// webhook addresses as `/32`s (empty, the default: any; refused in production, where
    /// `0.0.0.0/0` and `::/0` accept any on purpose); others get 403
    /// `webhook_source_refused` before their body is read. The address is the one the rate
    /// buckets use (`http_trusted_proxy_hops`).
    pub webhook_allowed_networks: Vec<String>,
    /// This deployment's purchase cell (bound into admission tokens). Set by `--cell` from
    /// the cell's entry in `cells`.
    pub purchase_cell: String,
    /// The purchase cells (TOML `[[cells]]`), for `--cell`, the `cells` commands and the
    /// router. Empty (the default): one cell, this configuration's own database.
    pub cells: Vec<CellSettings>,
    /// The control database holding the event directory (secret; belongs to no cell): read by
    /// the router and the `cells` commands, never by a cell's processes. Unset: no directory.
    #[serde(serialize_with = "redact_opt")]
    pub control_database_url: Option<SecretString>,
    /// Listen address of the router role.
    pub router_bind: String,
    /// How often the router re-reads the directory, ms; it keeps serving the last map it read
    /// while the control database is down.
    pub router_refresh_ms: u64,
    /// Bound of one forwarded request, ms (the cell's own edge bounds it too): of the whole
    /// answer, or of a buyer's order stream's head (its events then flow until it ends, or
    /// until the cell sends nothing for three `order_stream_heartbeat_s`).
    pub router_upstream_timeout_ms: u64,
    /// Proxies of the deployment in front of the router (`http_trusted_proxy_hops` of the
    /// router role, which counts clients for its per-address bounds). Unset: the router reads
    /// `http_trusted_proxy_hops`. The cells behind the router must trust one hop more (the
    /// router appends the address it saw), so one configuration file cannot give both the same
    /// value: in production, with `cells` listed, this must be set and `http_trusted_proxy_hops`
    /// must be exactly one more. Too few hops at a cell counts every buyer as the router; too
    /// many lets a buyer's own `X-Forwarded-For` entry pick the address it is counted as.
    pub router_trusted_proxy_hops: Option<u32>,
    /// This deployment's region (design §15), declared on every database session and stamped
    /// on every fact (`region` in envelopes and headers). Default `primary`.
    pub region: String,
    /// The region epoch this deployment writes at (≥ 1, default 1; `BOXOFFICE_REGION_EPOCH`).
    /// The ledger refuses every purchase write at any other epoch (SQLSTATE BXF01); after a
    /// promotion the new region's services start with the epoch `region promote` printed.
    pub region_epoch: i64,
    /// The region witness (secret): a database outside every region holding which region may
    /// write and the leases of its processes. When set, every process renews a lease there
    /// every `region_lease_renew_ms` and stops writing (the ledger refuses, BXF02) once it
    /// could not renew for `region_lease_ttl_ms`. Unset: no lease (one region only).
    #[serde(serialize_with = "redact_opt")]
    pub witness_database_url: Option<SecretString>,
    /// Lease TTL, ms (default 6000).
    pub region_lease_ttl_ms: u64,
    /// Lease renewal period, ms (default 1500; at most a third of the TTL).
    pub region_lease_renew_ms: u64,
    /// Clock-rate and transaction-duration margin a fence adds to the last old lease's
    /// expiry before promotion may proceed, ms (default 10000; at least
    /// `db_statement_timeout_ms`: a purchase transaction checked just before the lapse, a few
    /// statements sent back to back, each bounded by it, may commit that much later).
    pub region_lease_skew_ms: u64,
    /// The other region's database (secret), for `region fence`: when reachable, the old
    /// primary's epoch record is fenced too, the application role is made read-only there
    /// and its sessions are terminated. Unset or unreachable: the lease alone fences it.
    #[serde(serialize_with = "redact_opt")]
    pub region_peer_database_url: Option<SecretString>,
    /// `region republish` starts this long before the recovery point, ms (default 60000):
    /// covers commits whose outbox rows were written before their commit time. The outbox
    /// keeps published rows `outbox_retention_s`, which must exceed the worst replication lag
    /// plus this margin (checked against `region_max_replication_lag_s`).
    pub region_republish_margin_ms: u64,
    /// The worst replication lag the DR replica is allowed, s (default 300): the alarm
    /// threshold, and what the outbox's retention must cover (plus the republish margin).
    pub region_max_replication_lag_s: i64,
    /// HS256 secret that mints and verifies buyers' bearer tokens in development only (at
    /// least 32 bytes; the default is public). Production never accepts HS256.
    #[serde(serialize_with = "redact")]
    pub user_jwt_secret: SecretString,
    /// The identity provider's JWKS URL (`jwks_uri`, `https` in production). Buyer tokens
    /// signed with RS256, ES256 or EdDSA are verified with its keys, selected by `kid`.
    /// Production needs this or `user_jwks_file`.
    pub user_jwks_url: Option<String>,
    /// A JWKS file instead of a URL (same format, re-read like the URL).
    pub user_jwks_file: Option<String>,
    /// Required `iss` of buyer tokens (required in production).
    pub user_jwt_issuer: Option<String>,
    /// Required `aud` of buyer tokens: this API's identifier at the provider (required in
    /// production). Unset: tokens that carry an `aud` are refused.
    pub user_jwt_audience: Option<String>,
    /// Longest accepted buyer-token lifetime (`exp − iat`), seconds; tokens without `iat`
    /// are refused. Default 7200.
    pub user_jwt_max_lifetime_s: i64,
    /// Clock skew allowed on `exp`, `nbf` and `iat`, seconds.
    pub user_jwt_leeway_s: u64,
    /// The cached JWKS is re-read in the background once older than this, seconds.
    pub user_jwks_refresh_s: u64,
    /// Re-reads of the JWKS, including those a token with an unknown `kid` triggers, happen
    /// at most this often, seconds.
    pub user_jwks_min_refresh_s: u64,
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
    /// Bound of one Redis call on the hold path (revocation checks, the purchase and seat
    /// routes' rate buckets, which fall back when Redis does not answer), connecting
    /// included, ms (default 300).
    pub redis_timeout_ms: u64,
    /// Bound of one Redis call of the waiting room's own routes (join, poll, leave, their
    /// rate buckets) and of the release step, ms (default 1000, at least `redis_timeout_ms`):
    /// a dead Redis becomes a 503 this fast. Longer than the hold path's because the only
    /// alternative is a 503 the crowd retries, while the script that timed out has run.
    pub redis_queue_timeout_ms: u64,
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
    /// Threshold: p99 of hold → payable (client secret shown) over the recent holds, ms
    /// (default 15000: a buyer still gets the whole payment window, but a pipeline that
    /// takes longer is falling behind).
    pub release_threshold_payable_delay_ms: f64,
    /// Threshold: age of the oldest authorization reported in time and not yet confirmed, ms
    /// (default 20000; the hold is protected meanwhile, so this is the saga's lag, not a
    /// buyer's loss).
    pub release_threshold_authorization_wait_ms: f64,
    /// Threshold: share of the holds about to lapse unpaid that were never payable (0..=1).
    pub release_threshold_never_payable_share: f64,
    /// A queue position whose holder has not polled for this long lapses, ms (default 120000:
    /// a queued client is told to poll at most every third of it, so a deep queue polls
    /// rarely and a lost poll or two does not cost a position; a sixth of it caps the
    /// `Retry-After` of the queue's 503s while they keep coming,
    /// `boxoffice_api::edge::RefusalBackoff`). Time in which the waiting room could not
    /// answer does not count, up to three times this (`boxoffice_waitroom::LAPSE_GRACE_FACTOR`):
    /// a Redis unreachable or stopped for more than 5 s, and the queue routes refusing most
    /// callers `waitroom_unavailable` or `overloaded` past a streak's first second.
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
    /// The operator's bearer token for the `/admin` routes (the onsale dashboard), until
    /// operator identity exists: `Authorization: Bearer <admin_token>`, compared in constant
    /// time. Secret; at least 32 characters; the default is public (refused in production).
    #[serde(serialize_with = "redact")]
    pub admin_token: SecretString,
    /// `/admin` requests per second per client IP, authenticated or not (0 = none; default
    /// 5: the dashboard polls once a second).
    pub rate_limit_admin_ip_per_s: f64,
    /// Burst of the `/admin` routes' per-IP bucket, requests (default 30).
    pub rate_limit_admin_ip_burst: u32,
    /// `/admin` requests one client address may have in flight at once (default 4; 0 = no
    /// limit); one more is 429 `too_many_in_flight`.
    pub admin_max_in_flight_per_ip: usize,
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
    /// The least time a buyer gets to pay between the client secret appearing and the hold's
    /// expiry, ms: recording the PaymentIntent pushes `expires_at` to at least now + this
    /// (`boxoffice_domain::hold`, case C19). Default: 90 % of `hold_ttl_ms`.
    pub payment_window_ms: Option<u64>,
    /// The latest the payment window may push a hold's expiry, ms after its creation.
    /// Default: three times `hold_ttl_ms`.
    pub hold_ceiling_ms: Option<u64>,
    /// How long an authorization the provider reported while the hold was live keeps the
    /// hold from lapsing until the saga confirms it, ms at most (also bounded by the capture
    /// deadline less an hour). Default 30 minutes.
    pub authorization_settle_ms: u64,
    /// How long a payable hold at its end, with no authorization in the ledger, waits for
    /// the provider's word on its PaymentIntent before it lapses, ms at most (rule 3 of
    /// `boxoffice_domain::hold`: a late or starved webhook does not cost a paid buyer the
    /// seats). An answer that is not an authorization ends the wait at once. One provider
    /// read per such hold; 0 turns the check off; at most 600000. Default 30000.
    pub hold_provider_check_ms: u64,
    /// Whether a hold's `HoldCreated` is itself its order's authorization request, which the
    /// payment worker acts on (default `true`: one fact per new order). `false` writes a
    /// `PaymentAuthorizationRequested` command beside it, as older builds did. Set `false`
    /// while processes of an older build run beside this one (a rolling upgrade), and before
    /// the first older process starts in a rollback: an older payment worker does not act on
    /// a `HoldCreated`, and this build's saga leaves it to the payment worker, so such an
    /// order would get no PaymentIntent. A payment worker of this build acts on either form
    /// (README, "Rolling upgrades and rollbacks across the one-fact hold").
    pub hold_fact_requests_authorization: bool,
    /// Whether a confirmation's `OrderConfirmed` is itself its order's capture request, which
    /// the payment worker acts on (default `true`: one fact per confirmation). `false` writes
    /// a `CaptureRequested` command after it, as older builds did. Set `false` while
    /// processes of an older build run beside this one (a rolling upgrade), and before the
    /// first older process starts in a rollback: an older payment worker does not act on an
    /// `OrderConfirmed`, so such an order would never be captured. Only the saga reads it
    /// (in every process that runs the saga, following included). A payment worker of this
    /// build acts on either form (README, "Rolling upgrades and rollbacks across the one-fact
    /// confirmation").
    pub confirmation_fact_requests_capture: bool,
    /// Stripe API base URL: `https://api.stripe.com` in production, the simulator otherwise.
    /// Empty means "no provider configured": `audit` then skips its provider checks and
    /// `reconcile` refuses to run.
    pub stripe_api_base: String,
    /// Stripe secret key (`sk_…`/`rk_…`; at least 32 characters in production, a live key
    /// against `https://api.stripe.com`; a live key is refused in development and against
    /// any other base).
    #[serde(serialize_with = "redact")]
    pub stripe_secret_key: SecretString,
    /// Stripe publishable key (`pk_…`), used by simulated buyers only.
    pub stripe_publishable_key: String,
    /// Stripe webhook endpoint secret (`whsec_…`; at least 32 characters in production).
    #[serde(serialize_with = "redact")]
    pub stripe_webhook_secret: SecretString,
    /// Timeout of one Stripe call, ms.
    pub stripe_timeout_ms: u64,
    /// Stripe calls one process has in flight at once (default 32; 1..=1000); one more waits
    /// for a slot (`StripeClient::with_max_in_flight`). Without it a payment member could
    /// make `consumer_lanes × consumer_batch_max` calls at once under a backlog. Stripe
    /// limits an account's requests (<https://docs.stripe.com/rate-limits>): keep the sum
    /// over every process that calls it inside that.
    pub stripe_max_in_flight: usize,
    /// Outbox rows per relay batch.
    pub relay_batch: i64,
    /// The relay's lease, ms: how long the leading relay's PostgreSQL session may sit idle
    /// (`idle_session_timeout`) or wait to get a reply through (`tcp_user_timeout`) before
    /// the server ends it, and with it the outbox's lock, so a standing-by relay takes over
    /// from a frozen or unreachable one. Must exceed the producer's 30 s delivery timeout, so
    /// that what a silent leader had queued at the broker has timed out before another
    /// relay sends the same rows.
    pub relay_lease_ms: i64,
    /// How long an outbox row the producer refused (a message larger than it may send) stays
    /// parked, and its order with it, before the relay tries it again, s
    /// (default 300; 0 to 86,400; 0: the next batch). `boxoffice outbox retry` makes it due at
    /// once.
    pub relay_refused_retry_s: i64,
    /// Published outbox rows move to the order history after this many seconds.
    pub outbox_retention_s: i64,
    /// Where a process serves `/metrics` and `/healthz` apart from the API (e.g.
    /// `0.0.0.0:9100`): what a process running only workers or the relay needs to be scraped.
    /// Empty (the default): only the API's and the router's `/metrics`.
    pub metrics_bind: Option<String>,
    /// Live order streams (`GET /orders/{id}/events`) one user may have open per API process.
    pub order_stream_max_per_user: usize,
    /// Live order streams one client address may have open per API process, and through
    /// each router process.
    pub order_stream_max_per_ip: usize,
    /// Live order streams per API process, and relayed by each router process; more get 429
    /// `too_many_streams`. At most half of `http_max_connections`: a stream holds its
    /// connection for its whole life.
    pub order_stream_max: usize,
    /// Heartbeat (an SSE comment) of an idle order stream, seconds.
    pub order_stream_heartbeat_s: u64,
    /// An order stream ends after this many seconds (the client reconnects); 60–86,400.
    pub order_stream_max_lifetime_s: u64,
    /// Each order's facts, status changes and webhook events are kept this many days for its
    /// timeline (`boxoffice timeline`): 400 covers the card networks' 120-day dispute window
    /// and a year of bookkeeping. About 0.5 KB per fact and 0.1 KB per status change. Webhook
    /// events are kept at least four days whatever it says (Stripe's redelivery window).
    pub order_history_retention_days: i64,
    /// Holds expired per expiry transaction.
    pub expiry_batch: i64,
    /// Expiry sweep interval when idle, ms.
    pub expiry_interval_ms: u64,
    /// Confirmed orders still uncaptured this many seconds before Stripe's capture deadline
    /// are released and their authorization cancelled on purpose (case C09).
    pub capture_deadline_margin_s: i64,
    /// Inbox rows are pruned after this many seconds; keep it above the topics' retention
    /// ([`MIN_INBOX_RETENTION_S`]..=[`MAX_RETENTION_S`]).
    pub inbox_retention_s: i64,
    /// Webhook events recorded without an order id (another integration's PaymentIntents on
    /// the same Stripe account, event types boxoffice does not handle) are pruned after
    /// this many seconds (`BOXOFFICE_WEBHOOK_EVENT_RETENTION_S`; default 604,800, 7 days; at
    /// least 345,600, 4 days: Stripe redelivers for up to three, and the row is what makes a
    /// redelivery a duplicate; at most [`MAX_RETENTION_S`]). Events with an order id stay.
    pub webhook_event_retention_s: i64,
    /// Log format: `text` or `json`.
    pub log_format: String,
    /// OpenTelemetry collector to export spans to, OTLP over gRPC
    /// (`BOXOFFICE_OTLP_ENDPOINT`, e.g. `http://127.0.0.1:4317`; `http` or `https`). Unset
    /// (the default): no OpenTelemetry layer, no exporter, outbox rows without a
    /// `traceparent`. Set: one trace per purchase across every role (`crate::telemetry`).
    pub otlp_endpoint: Option<String>,
    /// Fault points to arm at start-up (`BOXOFFICE_FAULTS`), `point=actions;…` in the
    /// `fail` crate's syntax, e.g. `payments.after_remote=5%return(abort)`. Empty (the
    /// default) leaves every point inert; see `boxoffice_faults` for the points and modes.
    pub faults: String,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            env: Environment::Development,
            database_url: "postgres://postgres@127.0.0.1:5432/boxoffice".into(),
            db_max_connections: 8,
            db_pool_api: 20,
            db_pool_webhooks: 4,
            db_pool_relay: 1,
            db_pool_saga: 9,
            db_pool_payments: 9,
            db_pool_tickets: 9,
            db_pool_expiry: 2,
            db_acquire_timeout_ms: 3_000,
            db_statement_timeout_ms: 10_000,
            db_plan_cache_mode: "force_generic_plan".into(),
            kafka_brokers: None,
            kafka_topic_prefix: String::new(),
            kafka_security_protocol: None,
            kafka_sasl_mechanism: None,
            kafka_sasl_username: None,
            kafka_sasl_password: None,
            kafka_ssl_ca_location: None,
            kafka_partitions: 12,
            kafka_replication: 1,
            consumers_per_role: 1,
            consumer_lanes: 8,
            consumer_batch_max: 16,
            consumer_fetch_min_bytes: 1,
            consumer_fetch_wait_ms: 20,
            consumer_batch_linger_ms: 0,
            consumer_transactions_max: 0,
            consumer_group_commit: false,
            consumer_group_commits_max: 1,
            follow_through: true,
            consumer_inline_attempts: 3,
            consumer_retry_5s_delay_ms: 5_000,
            consumer_retry_1m_delay_ms: 60_000,
            consumer_max_attempts: 8,
            http_bind: "127.0.0.1:8080".into(),
            http_header_read_timeout_ms: 5_000,
            http_request_timeout_ms: 15_000,
            http_request_body_timeout_ms: 5_000,
            http_max_concurrent_requests: 512,
            http_max_in_flight_per_ip: 32,
            webhook_max_in_flight_per_ip: 8,
            waitroom_max_concurrent_requests: 256,
            holds_max_concurrent_requests: 256,
            webhook_batch_max: boxoffice_api::webhooks::DEFAULT_BATCH_MAX,
            webhook_timeout_ms: 3_000,
            webhook_allowed_networks: Vec::new(),
            http_max_connections: 4_096,
            purchase_cell: "cell-1".into(),
            cells: Vec::new(),
            control_database_url: None,
            router_bind: "127.0.0.1:8090".into(),
            router_refresh_ms: 1_000,
            router_upstream_timeout_ms: 15_000,
            router_trusted_proxy_hops: None,
            region: "primary".into(),
            region_epoch: 1,
            witness_database_url: None,
            region_lease_ttl_ms: 6_000,
            region_lease_renew_ms: 1_500,
            region_lease_skew_ms: 10_000,
            region_peer_database_url: None,
            region_republish_margin_ms: 60_000,
            region_max_replication_lag_s: 300,
            user_jwt_secret: DEV_USER_JWT_SECRET.into(),
            user_jwks_url: None,
            user_jwks_file: None,
            user_jwt_issuer: None,
            user_jwt_audience: None,
            user_jwt_max_lifetime_s: 7_200,
            user_jwt_leeway_s: 30,
            user_jwks_refresh_s: 300,
            user_jwks_min_refresh_s: 30,
            admission_kid: boxoffice_admission::DEV_KID.into(),
            admission_private_key: AdmissionSigningKey::dev().to_pkcs8_pem().into(),
            admission_public_keys: Vec::new(),
            admission_direct: false,
            admission_ttl_s: 900,
            redis_url: "redis://127.0.0.1:6379".into(),
            redis_key_prefix: "boxoffice:".into(),
            redis_timeout_ms: 300,
            redis_queue_timeout_ms: 1_000,
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
            release_threshold_payable_delay_ms: 15_000.0,
            release_threshold_authorization_wait_ms: 20_000.0,
            release_threshold_never_payable_share: 0.05,
            waitroom_abandon_after_ms: 120_000,
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
            admin_token: DEV_ADMIN_TOKEN.into(),
            rate_limit_admin_ip_per_s: 5.0,
            rate_limit_admin_ip_burst: 30,
            admin_max_in_flight_per_ip: 4,
            http_trusted_proxy_hops: 0,
            http_trust_forwarded_for: None,
            hold_ttl_ms: 300_000,
            payment_window_ms: None,
            hold_ceiling_ms: None,
            authorization_settle_ms: 1_800_000,
            hold_provider_check_ms: 30_000,
            hold_fact_requests_authorization: true,
            confirmation_fact_requests_capture: true,
            stripe_api_base: "https://api.stripe.com".into(),
            stripe_secret_key: DEV_STRIPE_SECRET_KEY.into(),
            stripe_publishable_key: "pk_test_boxoffice_dev".into(),
            stripe_webhook_secret: DEV_WEBHOOK_SECRETS[0].into(),
            stripe_timeout_ms: 10_000,
            stripe_max_in_flight: 32,
            relay_batch: 500,
            relay_lease_ms: 45_000,
            relay_refused_retry_s: 300,
            outbox_retention_s: 3_600,
            order_history_retention_days: 400,
            metrics_bind: None,
            order_stream_max_per_user: 4,
            order_stream_max_per_ip: 16,
            order_stream_max: 2_048,
            order_stream_heartbeat_s: 15,
            order_stream_max_lifetime_s: 900,
            expiry_batch: 500,
            expiry_interval_ms: 250,
            capture_deadline_margin_s: 86_400,
            inbox_retention_s: 7 * 86_400,
            webhook_event_retention_s: boxoffice_store::stripe_events::UNCLAIMED_RETENTION_S,
            log_format: "text".into(),
            otlp_endpoint: None,
            faults: String::new(),
        }
    }
}

impl Config {
    /// Defaults (with `env` = `default_env`) → `file` (if any) → `BOXOFFICE_*` environment,
    /// then [`Config::validate`]. A refusal of the secrets is a [`SecretFindings`] error.
    pub fn load(file: Option<&Path>, default_env: Environment) -> anyhow::Result<Self> {
        let mut fig = Figment::from(Serialized::defaults(Config::default()));
        // Serialized defaults carry "[redacted]" for secrets: put the real defaults back.
        let d = Config::default();
        fig = fig
            .merge(Serialized::default("env", default_env))
            .merge(Serialized::default("database_url", d.database_url.expose_secret()))
            .merge(Serialized::default("user_jwt_secret", d.user_jwt_secret.expose_secret()))
            .merge(Serialized::default("stripe_secret_key", d.stripe_secret_key.expose_secret()))
            .merge(Serialized::default("stripe_webhook_secret", d.stripe_webhook_secret.expose_secret()))
            .merge(Serialized::default("admission_private_key", d.admission_private_key.expose_secret()))
            .merge(Serialized::default("redis_url", d.redis_url.expose_secret()))
            .merge(Serialized::default("admin_token", d.admin_token.expose_secret()));
        if let Some(f) = file {
            fig = fig.merge(Toml::file_exact(f));
        }
        // Secrets are taken from the environment verbatim: figment would read `12345` as a
        // number, `true` as a bool and strip quotes, then quote the value in its error.
        fig = fig.merge(Env::prefixed("BOXOFFICE_").ignore(&SECRET_KEYS));
        for key in SECRET_KEYS {
            match std::env::var(format!("BOXOFFICE_{}", key.to_uppercase())) {
                Ok(v) => fig = fig.merge(Serialized::default(key, v)),
                Err(std::env::VarError::NotUnicode(_)) => {
                    bail!("BOXOFFICE_{}: not UTF-8", key.to_uppercase())
                }
                Err(std::env::VarError::NotPresent) => {}
            }
        }
        let cfg: Config = fig.extract().context("invalid configuration")?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks ranges and required secrets.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.hold_ttl_ms < 1_000 {
            bail!("hold_ttl_ms must be at least 1000");
        }
        if let Err(e) = self.hold_policy().validate() {
            bail!(
                "payment_window_ms / hold_ceiling_ms / authorization_settle_ms / hold_provider_check_ms: {e}"
            );
        }
        if self.kafka_partitions < 1 || self.kafka_replication < 1 {
            bail!("kafka_partitions and kafka_replication must be at least 1");
        }
        if self.consumer_lanes < 1 || self.consumer_lanes > 256 || self.consumers_per_role < 1 {
            bail!("consumer_lanes must be 1..=256 and consumers_per_role at least 1");
        }
        if !(1..=1_048_576).contains(&self.consumer_fetch_min_bytes) {
            bail!("consumer_fetch_min_bytes must be 1..=1048576 (bytes)");
        }
        if !(1..=1_000).contains(&self.consumer_fetch_wait_ms) {
            bail!("consumer_fetch_wait_ms must be 1..=1000 (ms)");
        }
        if self.consumer_batch_linger_ms > 100 {
            bail!("consumer_batch_linger_ms must be 0..=100 (ms)");
        }
        if self.consumer_transactions_max > self.consumer_lanes {
            bail!(
                "consumer_transactions_max must be 0 (one per lane) or 1..=consumer_lanes ({}), not {}",
                self.consumer_lanes,
                self.consumer_transactions_max
            );
        }
        if self.consumer_group_commit && self.consumer_transactions_max != 0 {
            bail!(
                "consumer_group_commit limits a member's transactions with consumer_group_commits_max: set it to false to use consumer_transactions_max"
            );
        }
        if !(1..=256).contains(&self.consumer_group_commits_max) {
            bail!("consumer_group_commits_max must be 1..=256, not {}", self.consumer_group_commits_max);
        }
        if !["auto", "force_generic_plan", "force_custom_plan"].contains(&self.db_plan_cache_mode.as_str()) {
            bail!("db_plan_cache_mode must be auto, force_generic_plan or force_custom_plan");
        }
        if !(1..=1_000).contains(&self.stripe_max_in_flight) {
            bail!("stripe_max_in_flight must be 1..=1000");
        }
        if !(1..=1_000).contains(&self.consumer_batch_max) {
            bail!("consumer_batch_max must be 1..=1000");
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
        if !(1..=36_500).contains(&self.order_history_retention_days) {
            bail!("order_history_retention_days must be 1..=36500");
        }
        if !(boxoffice_store::stripe_events::MIN_UNCLAIMED_RETENTION_S..=MAX_RETENTION_S)
            .contains(&self.webhook_event_retention_s)
        {
            bail!(
                "webhook_event_retention_s must be {}..={MAX_RETENTION_S} (at least four days: Stripe redelivers a webhook for up to three)",
                boxoffice_store::stripe_events::MIN_UNCLAIMED_RETENTION_S
            );
        }
        if !(MIN_INBOX_RETENTION_S..=MAX_RETENTION_S).contains(&self.inbox_retention_s) {
            bail!(
                "inbox_retention_s must be {MIN_INBOX_RETENTION_S}..={MAX_RETENTION_S}: a row pruned while its message can still be redelivered lets it apply twice"
            );
        }
        if self.order_stream_max > self.http_max_connections / 2 {
            bail!(
                "order_stream_max ({}) must be at most half of http_max_connections ({}): a stream holds its connection for its whole life",
                self.order_stream_max,
                self.http_max_connections
            );
        }
        if self.order_stream_max_per_user < 1
            || self.order_stream_max_per_ip < 1
            || self.order_stream_max < self.order_stream_max_per_user
            || !(1..=120).contains(&self.order_stream_heartbeat_s)
            || !(60..=86_400).contains(&self.order_stream_max_lifetime_s)
        {
            bail!(
                "order_stream_max_per_user must be at least 1 and at most order_stream_max, \
                 order_stream_heartbeat_s 1..=120 and order_stream_max_lifetime_s 60..=86400"
            );
        }
        if !(50..=10_000).contains(&self.redis_timeout_ms) {
            bail!("redis_timeout_ms must be 50..=10000");
        }
        if !(self.redis_timeout_ms..=10_000).contains(&self.redis_queue_timeout_ms) {
            bail!("redis_queue_timeout_ms must be redis_timeout_ms..=10000");
        }
        if self.waitroom_poll_interval_ms < 100
            || self.waitroom_poll_interval_ms * 2 > self.waitroom_abandon_after_ms
        {
            bail!("waitroom_poll_interval_ms must be at least 100 and at most half of waitroom_abandon_after_ms");
        }
        // A client that follows every instruction — poll when told (at most a third of the
        // lapse time), then a 503's longest Retry-After — must keep its position.
        let retry_ms = boxoffice_api::problem::WAITROOM_RETRY_AFTER_S.end() * 1_000;
        if self.waitroom_abandon_after_ms < 3 * retry_ms {
            bail!("waitroom_abandon_after_ms must be at least {} (three of the waiting room's longest Retry-After)", 3 * retry_ms);
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
            self.rate_limit_admin_ip_per_s,
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
            self.rate_limit_admin_ip_burst,
        ];
        if bursts.iter().any(|b| *b < 1) {
            bail!("rate_limit_*_burst must be at least 1");
        }
        self.validate_http()?;
        if self.stripe_webhook_secret.expose_secret().is_empty()
            || self.stripe_secret_key.expose_secret().is_empty()
        {
            bail!("stripe_secret_key and stripe_webhook_secret are required");
        }
        self.validate_user_tokens()?;
        self.validate_kafka_security()?;
        if self.relay_lease_ms <= 30_000 {
            bail!("relay_lease_ms must exceed the producer's 30 s delivery timeout");
        }
        if !(0..=86_400).contains(&self.relay_refused_retry_s) {
            bail!("relay_refused_retry_s must be 0 to 86400 (a day)");
        }
        if !matches!(self.log_format.as_str(), "text" | "json") {
            bail!("log_format must be text or json");
        }
        if let Some(e) = &self.otlp_endpoint {
            let rest = e.strip_prefix("http://").or_else(|| e.strip_prefix("https://")).unwrap_or("");
            if rest.is_empty() || rest.contains(char::is_whitespace) {
                bail!("otlp_endpoint must be an http:// or https:// URL of an OTLP/gRPC collector");
            }
        }
        boxoffice_faults::validate(&self.faults).map_err(|e| anyhow::anyhow!("faults: {e}"))?;
        self.validate_cells()?;
        let refused: Vec<SecretFinding> = self
            .secret_findings()
            .into_iter()
            .filter(|f| self.env == Environment::Production || f.severity == Severity::Always)
            .collect();
        if !refused.is_empty() {
            return Err(SecretFindings { env: self.env, findings: refused }.into());
        }
        Ok(())
    }

    /// The router role's trusted proxy hops: `router_trusted_proxy_hops`, or
    /// `http_trusted_proxy_hops` when unset.
    pub fn router_proxy_hops(&self) -> u32 {
        self.router_trusted_proxy_hops.unwrap_or(self.http_trusted_proxy_hops)
    }

    /// Cells are distinct in name, database, topic prefix and Redis prefix, and the control
    /// database is none of theirs (it belongs to no cell); in production, a configuration
    /// listing cells sets `router_trusted_proxy_hops` and the cells trust one hop more.
    fn validate_cells(&self) -> anyhow::Result<()> {
        let mut names = std::collections::HashSet::new();
        let mut dbs = std::collections::HashSet::new();
        let mut topics = std::collections::HashSet::new();
        let mut keys = std::collections::HashSet::new();
        for c in &self.cells {
            if c.name.is_empty()
                || !c.name.chars().all(|ch| ch.is_ascii_alphanumeric() || ch == '-' || ch == '_')
            {
                bail!("cells: a cell name is 1+ characters of [A-Za-z0-9_-], got {:?}", c.name);
            }
            if !names.insert(c.name.as_str()) {
                bail!("cells: {} is listed twice", c.name);
            }
            if !dbs.insert(database_key(&c.database_url, "cells")?) {
                bail!("cells: {} shares its database_url with another cell", c.name);
            }
            if !topics.insert(c.kafka_topic_prefix.as_str()) {
                bail!("cells: {} shares its kafka_topic_prefix with another cell", c.name);
            }
            if !keys.insert(c.redis_key_prefix.as_str()) {
                bail!("cells: {} shares its redis_key_prefix with another cell", c.name);
            }
        }
        if let Some(control) = &self.control_database_url {
            if dbs.contains(&database_key(control, "control_database_url")?) {
                bail!("control_database_url: the directory belongs to no cell; give it its own database");
            }
        }
        if self.router_refresh_ms < 100 || self.router_upstream_timeout_ms < 100 {
            bail!("router_refresh_ms and router_upstream_timeout_ms must be at least 100");
        }
        if self.env == Environment::Production && !self.cells.is_empty() {
            match self.router_trusted_proxy_hops {
                Some(router) if self.http_trusted_proxy_hops == router + 1 => {}
                Some(router) => bail!(
                    "http_trusted_proxy_hops ({}) must be router_trusted_proxy_hops ({router}) + 1: the cells \
                     behind the router trust its hop too",
                    self.http_trusted_proxy_hops
                ),
                None => bail!(
                    "router_trusted_proxy_hops must be set when cells are listed (the proxies in front of \
                     the router; the cells' http_trusted_proxy_hops is one more)"
                ),
            }
        }
        self.validate_region()
    }

    /// Checks the region settings (design §15).
    fn validate_region(&self) -> anyhow::Result<()> {
        if self.region.is_empty()
            || !self.region.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            bail!("region must be a non-empty name of letters, digits, '-' and '_'");
        }
        if self.region_epoch < 1 {
            bail!("region_epoch must be at least 1");
        }
        if self.region_lease_renew_ms < 100 || self.region_lease_renew_ms * 3 > self.region_lease_ttl_ms {
            bail!("region_lease_renew_ms must be at least 100 and at most a third of region_lease_ttl_ms");
        }
        if self.witness_database_url.is_some()
            && (self.db_statement_timeout_ms == 0 || self.region_lease_skew_ms < self.db_statement_timeout_ms)
        {
            bail!(
                "with a witness, db_statement_timeout_ms must be set and region_lease_skew_ms must cover it: \
                 a write checked just before its lease lapsed may commit up to that long after"
            );
        }
        let margin_s = self.region_republish_margin_ms.div_ceil(1_000) as i64;
        if self.outbox_retention_s < self.region_max_replication_lag_s + margin_s {
            bail!(
                "outbox_retention_s ({}) must exceed region_max_replication_lag_s ({}) plus the republish margin ({margin_s} s): \
                 after a failover the promoted region republishes the outbox from the recovery point",
                self.outbox_retention_s,
                self.region_max_replication_lag_s
            );
        }
        if let Some(w) = &self.witness_database_url {
            if database_key(w, "witness_database_url")? == database_key(&self.database_url, "database_url")? {
                bail!(
                    "witness_database_url: the witness lives outside every region; give it its own database"
                );
            }
        }
        Ok(())
    }

    /// This configuration for one process of cell `name`: the cell's database, topic prefix,
    /// Redis prefix and name, and nothing of any other cell or of the control database — a
    /// cell's process holds exactly one database URL.
    ///
    /// # Errors
    /// When `cells` lists no such cell.
    pub fn for_cell(&self, name: &str) -> anyhow::Result<Config> {
        let cell =
            self.cells.iter().find(|c| c.name == name).with_context(|| {
                format!("no cell {name:?} in cells (configured: {:?})", self.cell_names())
            })?;
        let mut c = self.clone();
        c.database_url = cell.database_url.clone();
        c.kafka_topic_prefix = cell.kafka_topic_prefix.clone();
        c.redis_key_prefix = cell.redis_key_prefix.clone();
        c.purchase_cell = cell.name.clone();
        c.cells = Vec::new();
        c.control_database_url = None;
        Ok(c)
    }

    /// The names of the configured cells.
    pub fn cell_names(&self) -> Vec<&str> {
        self.cells.iter().map(|c| c.name.as_str()).collect()
    }

    /// Checks the buyer-token settings' shapes (what production requires is a finding).
    fn validate_user_tokens(&self) -> anyhow::Result<()> {
        if self.user_jwks_url.is_some() && self.user_jwks_file.is_some() {
            bail!("set user_jwks_url or user_jwks_file, not both");
        }
        if let Some(url) = &self.user_jwks_url {
            if !(url.starts_with("https://") || url.starts_with("http://")) {
                bail!("user_jwks_url must be an http(s) URL");
            }
        }
        if self.user_jwt_max_lifetime_s < 1 {
            bail!("user_jwt_max_lifetime_s must be at least 1");
        }
        if self.user_jwt_leeway_s > 300 {
            bail!("user_jwt_leeway_s must be at most 300");
        }
        if self.user_jwks_refresh_s < 1 || self.user_jwks_min_refresh_s > self.user_jwks_refresh_s {
            bail!("user_jwks_refresh_s must be at least 1 and at least user_jwks_min_refresh_s");
        }
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
        self.webhook_networks()?;
        if self.webhook_timeout_ms == 0 {
            bail!("webhook_timeout_ms must be above 0");
        }
        if !(1..=1_000).contains(&self.webhook_batch_max) {
            bail!("webhook_batch_max must be 1..=1000");
        }
        if self.http_max_concurrent_requests < 1 || self.http_max_connections < 1 {
            bail!("http_max_concurrent_requests and http_max_connections must be at least 1");
        }
        if !(1..self.http_max_concurrent_requests).contains(&self.waitroom_max_concurrent_requests) {
            bail!(
                "waitroom_max_concurrent_requests must be at least 1 and below http_max_concurrent_requests"
            );
        }
        if !(1..self.http_max_concurrent_requests).contains(&self.holds_max_concurrent_requests) {
            bail!("holds_max_concurrent_requests must be at least 1 and below http_max_concurrent_requests");
        }
        if self.http_trust_forwarded_for.is_some() {
            bail!("http_trust_forwarded_for was replaced by http_trusted_proxy_hops (true = 1 hop)");
        }
        if self.http_trusted_proxy_hops > 16 || self.router_trusted_proxy_hops.is_some_and(|h| h > 16) {
            bail!("http_trusted_proxy_hops and router_trusted_proxy_hops must be 0..=16");
        }
        Ok(())
    }

    /// Checks that the Kafka security settings fit together.
    fn validate_kafka_security(&self) -> anyhow::Result<()> {
        use boxoffice_bus::SecurityProtocol;
        let protocol = self.kafka_security_protocol.unwrap_or(SecurityProtocol::Plaintext);
        let sasl_set = self.kafka_sasl_mechanism.is_some()
            || self.kafka_sasl_username.is_some()
            || self.kafka_sasl_password.is_some();
        if protocol.is_sasl() {
            if self.kafka_sasl_mechanism.is_none()
                || self.kafka_sasl_username.as_deref().is_none_or(str::is_empty)
                || self.kafka_sasl_password.as_ref().is_none_or(|p| p.expose_secret().is_empty())
            {
                bail!(
                    "kafka_security_protocol {} needs kafka_sasl_mechanism, kafka_sasl_username and kafka_sasl_password",
                    protocol.as_str()
                );
            }
        } else if sasl_set {
            bail!("kafka_sasl_* settings need kafka_security_protocol sasl_ssl or sasl_plaintext");
        }
        if let Some(ca) = &self.kafka_ssl_ca_location {
            if !protocol.is_tls() {
                bail!("kafka_ssl_ca_location needs kafka_security_protocol ssl or sasl_ssl");
            }
            if !Path::new(ca).is_file() {
                bail!("kafka_ssl_ca_location: no file at {ca:?}");
            }
        }
        Ok(())
    }

    /// Every secret-related problem of this configuration for its [`Config::env`], whatever
    /// its [`Severity`]. Names settings, never values.
    pub fn secret_findings(&self) -> Vec<SecretFinding> {
        let prod = self.env == Environment::Production;
        let mut out = Vec::new();
        let mut push = |key: &'static str, severity: Severity, problem: String| {
            out.push(SecretFinding { key, problem, severity });
        };
        let builtin = "the built-in development value (public in the source)";

        // Buyer tokens.
        if prod {
            let (url, file) = (self.user_jwks_url.as_deref(), self.user_jwks_file.as_deref());
            if url.is_none_or(str::is_empty) && file.is_none_or(str::is_empty) {
                push(
                    "user_jwks_url",
                    Severity::ProductionOnly,
                    "not set (nor user_jwks_file): production verifies buyer tokens only with the \
                     identity provider's keys (RS256, ES256, EdDSA); HS256 with user_jwt_secret is \
                     development only"
                        .into(),
                );
            }
            if url.is_some_and(|u| !u.starts_with("https://")) {
                push("user_jwks_url", Severity::ProductionOnly, "must be an https URL in production".into());
            }
            if self.user_jwt_issuer.as_deref().is_none_or(str::is_empty) {
                push(
                    "user_jwt_issuer",
                    Severity::ProductionOnly,
                    "not set: production requires the identity provider's issuer (`iss`)".into(),
                );
            }
            if self.user_jwt_audience.as_deref().is_none_or(str::is_empty) {
                push(
                    "user_jwt_audience",
                    Severity::ProductionOnly,
                    "not set: production requires this API's audience (`aud`)".into(),
                );
            }
        } else {
            let secret = self.user_jwt_secret.expose_secret();
            if secret == DEV_USER_JWT_SECRET {
                push("user_jwt_secret", Severity::Development, builtin.into());
            } else if secret.len() < MIN_USER_JWT_SECRET_BYTES {
                push(
                    "user_jwt_secret",
                    Severity::Development,
                    format!("shorter than {MIN_USER_JWT_SECRET_BYTES} bytes"),
                );
            }
        }

        // Admission tokens: the development key mints tokens that skip the queue.
        let dev_key = AdmissionSigningKey::dev().verifying_key();
        let signing = pem_or_file(self.admission_private_key.expose_secret(), "admission_private_key")
            .ok()
            .and_then(|pem| AdmissionSigningKey::from_pem(&self.admission_kid, &pem).ok());
        if signing.is_some_and(|k| k.verifying_key().to_pem() == dev_key.to_pem()) {
            push(
                "admission_private_key",
                Severity::Development,
                format!("{builtin}: generate one with `boxoffice admission-keygen --kid K`"),
            );
        }
        let dev_pem = dev_key.to_pem();
        let lists_dev = self.admission_public_keys.iter().any(|k| {
            pem_or_file(&k.public_key, "admission_public_keys").is_ok_and(|p| p.trim() == dev_pem.trim())
        });
        if lists_dev {
            push(
                "admission_public_keys",
                Severity::Development,
                "lists the built-in development key: tokens anyone can mint would be accepted".into(),
            );
        }

        // Stripe.
        let key = self.stripe_secret_key.expose_secret();
        let base = self.stripe_api_base.trim();
        let live_api = boxoffice_payments::is_stripe_api(base);
        let mode = boxoffice_payments::KeyMode::of(key);
        if key == DEV_STRIPE_SECRET_KEY {
            push("stripe_secret_key", Severity::Development, builtin.into());
        }
        if key.len() < MIN_STRIPE_SECRET_KEY_CHARS {
            push(
                "stripe_secret_key",
                Severity::Development,
                format!("shorter than {MIN_STRIPE_SECRET_KEY_CHARS} characters"),
            );
        }
        if prod && live_api && mode == boxoffice_payments::KeyMode::Test {
            push(
                "stripe_secret_key",
                Severity::ProductionOnly,
                format!("a test key (sk_test_…/rk_test_…) against {base}: production takes a live key"),
            );
        }
        let https = base.trim().get(..8).is_some_and(|scheme| scheme.eq_ignore_ascii_case("https://"));
        if mode == boxoffice_payments::KeyMode::Live && !base.is_empty() && !(live_api && https) {
            push(
                "stripe_secret_key",
                Severity::Always,
                format!("a live key (sk_live_…/rk_live_…) would be sent to {base}, which is not https://api.stripe.com"),
            );
        }
        if mode == boxoffice_payments::KeyMode::Live && !prod {
            push(
                "stripe_secret_key",
                Severity::Always,
                "a live key in development (which accepts HS256 buyer tokens): live payments need env = production"
                    .into(),
            );
        }
        let webhook = self.stripe_webhook_secret.expose_secret();
        if DEV_WEBHOOK_SECRETS.contains(&webhook) {
            let problem = if prod && live_api {
                format!("{builtin}, with {base}: anyone could sign webhook claims, each costing a recorded event and, within each order's budget, a provider call")
            } else {
                builtin.into()
            };
            push("stripe_webhook_secret", Severity::Development, problem);
        }
        if webhook.len() < MIN_WEBHOOK_SECRET_CHARS {
            push(
                "stripe_webhook_secret",
                Severity::Development,
                format!("shorter than {MIN_WEBHOOK_SECRET_CHARS} characters"),
            );
        }

        // The operator token: whoever holds it reads the dashboard.
        let admin = self.admin_token.expose_secret();
        if admin == DEV_ADMIN_TOKEN {
            push(
                "admin_token",
                Severity::Development,
                format!("{builtin}: anyone could read the operator's /admin routes"),
            );
        } else if admin.len() < MIN_ADMIN_TOKEN_CHARS {
            push(
                "admin_token",
                Severity::Development,
                format!("shorter than {MIN_ADMIN_TOKEN_CHARS} characters"),
            );
        }

        // Webhook senders: without a list, any address may hold webhook slots (a sender with
        // many IPv6 /64s, each allowed `webhook_max_in_flight_per_ip` slow requests, can fill
        // the webhook bulkhead). Listing every network (`0.0.0.0/0`, `::/0`) is a choice too.
        if prod && self.webhook_allowed_networks.is_empty() {
            push(
                "webhook_allowed_networks",
                Severity::ProductionOnly,
                "not set: production accepts webhooks only from listed networks (Stripe's published \
                 webhook addresses; `0.0.0.0/0` and `::/0` to accept any)"
                    .into(),
            );
        }

        // The queue bypass: `POST /events/{id}/admission` admits anyone at once.
        if self.admission_direct {
            push(
                "admission_direct",
                Severity::Development,
                "serves POST /events/{id}/admission, which admits any buyer without the waiting room".into(),
            );
        }

        // Kafka.
        if let Some(p) = &self.kafka_sasl_password {
            if p.expose_secret().len() < MIN_KAFKA_PASSWORD_CHARS {
                push(
                    "kafka_sasl_password",
                    Severity::Development,
                    format!("shorter than {MIN_KAFKA_PASSWORD_CHARS} characters"),
                );
            }
        }
        if prod
            && self.kafka_security_protocol == Some(boxoffice_bus::SecurityProtocol::SaslPlaintext)
            && self.kafka_sasl_mechanism == Some(boxoffice_bus::SaslMechanism::Plain)
        {
            push(
                "kafka_security_protocol",
                Severity::ProductionOnly,
                "SASL PLAIN over sasl_plaintext sends the password in the clear: use sasl_ssl".into(),
            );
        }
        out
    }

    /// In development, one line per setting whose value is a built-in development default or
    /// too short (what production would refuse); empty in production, where
    /// [`Config::validate`] refuses them instead.
    pub fn development_warnings(&self) -> Vec<(&'static str, String)> {
        if self.env == Environment::Production {
            return Vec::new();
        }
        let dev: Vec<SecretFinding> =
            self.secret_findings().into_iter().filter(|f| f.severity == Severity::Development).collect();
        by_key(&dev)
    }

    /// What buyer tokens must satisfy.
    pub fn user_token_policy(&self) -> boxoffice_admission::UserTokenPolicy {
        let non_empty = |v: &Option<String>| v.clone().filter(|s| !s.is_empty());
        boxoffice_admission::UserTokenPolicy {
            issuer: non_empty(&self.user_jwt_issuer),
            audience: non_empty(&self.user_jwt_audience),
            max_lifetime_s: self.user_jwt_max_lifetime_s,
            leeway_s: self.user_jwt_leeway_s,
        }
    }

    /// Where and how often the identity provider's keys are read, when configured.
    pub fn jwks_settings(&self) -> Option<boxoffice_admission::JwksSettings> {
        use boxoffice_admission::{JwksSettings, JwksSource};
        let source = match (&self.user_jwks_url, &self.user_jwks_file) {
            (Some(url), _) if !url.is_empty() => JwksSource::Url(url.clone()),
            (_, Some(file)) if !file.is_empty() => JwksSource::File(file.into()),
            _ => return None,
        };
        Some(JwksSettings {
            refresh_after: std::time::Duration::from_secs(self.user_jwks_refresh_s),
            min_refresh_interval: std::time::Duration::from_secs(self.user_jwks_min_refresh_s),
            ..JwksSettings::new(source)
        })
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
            admin: RouteBuckets {
                ip: bucket(self.rate_limit_admin_ip_per_s, self.rate_limit_admin_ip_burst),
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
            payable_delay_ms: self.release_threshold_payable_delay_ms,
            authorization_wait_ms: self.release_threshold_authorization_wait_ms,
            never_payable_share: self.release_threshold_never_payable_share,
        }
    }

    /// `webhook_allowed_networks` parsed (a bare address is its /32 or /128). An IPv4-mapped
    /// IPv6 network (`::ffff:a.b.c.d/N`, N ≥ 96) is read as the IPv4 network it maps, since a
    /// client's address is compared in its canonical form (an IPv4 client on a dual-stack
    /// socket is its IPv4 address). Errors name the entry that does not parse.
    pub fn webhook_networks(&self) -> anyhow::Result<Vec<ipnet::IpNet>> {
        self.webhook_allowed_networks
            .iter()
            .map(|n| {
                let n = n.trim();
                let net = n
                    .parse::<ipnet::IpNet>()
                    .or_else(|_| n.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
                    .map_err(|_| anyhow::anyhow!("webhook_allowed_networks: {n:?} is not a CIDR network"))?;
                Ok(match net {
                    ipnet::IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.addr().to_ipv4_mapped() {
                        Some(v4) => ipnet::IpNet::V4(
                            ipnet::Ipv4Net::new(v4, v6.prefix_len() - 96).expect("a prefix of at most 32"),
                        ),
                        None => net,
                    },
                    _ => net,
                })
            })
            .collect()
    }

    /// How a hold asks for its order's authorization, from `hold_fact_requests_authorization`.
    pub fn authorization_request(&self) -> boxoffice_domain::saga::AuthorizationRequest {
        use boxoffice_domain::saga::AuthorizationRequest;
        if self.hold_fact_requests_authorization {
            AuthorizationRequest::InHoldFact
        } else {
            AuthorizationRequest::Command
        }
    }

    /// How a confirmation asks for its order's capture, from
    /// `confirmation_fact_requests_capture`.
    pub fn capture_request(&self) -> boxoffice_domain::saga::CaptureRequest {
        use boxoffice_domain::saga::CaptureRequest;
        if self.confirmation_fact_requests_capture {
            CaptureRequest::InConfirmationFact
        } else {
            CaptureRequest::Command
        }
    }

    /// The hold's lifetime rules ([`boxoffice_domain::HoldPolicy`]): `hold_ttl_ms`, with the
    /// payment window, ceiling and settle time configured or derived from it.
    pub fn hold_policy(&self) -> boxoffice_domain::HoldPolicy {
        let ttl = std::time::Duration::from_millis(self.hold_ttl_ms);
        let d = boxoffice_domain::HoldPolicy::for_ttl(ttl);
        let ms = std::time::Duration::from_millis;
        boxoffice_domain::HoldPolicy {
            ttl,
            payment_window: self.payment_window_ms.map(ms).unwrap_or(d.payment_window),
            ceiling: self.hold_ceiling_ms.map(ms).unwrap_or(d.ceiling),
            settle: ms(self.authorization_settle_ms),
            provider_check: ms(self.hold_provider_check_ms),
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
            security: boxoffice_bus::KafkaSecurity {
                protocol: self.kafka_security_protocol,
                sasl_mechanism: self.kafka_sasl_mechanism,
                sasl_username: self.kafka_sasl_username.clone(),
                sasl_password: self.kafka_sasl_password.clone(),
                ssl_ca_location: self.kafka_ssl_ca_location.clone(),
            },
            prefix: self.kafka_topic_prefix.clone(),
            partitions: self.kafka_partitions,
            replication: self.kafka_replication,
            retry: boxoffice_bus::RetryPolicy {
                inline_attempts: self.consumer_inline_attempts,
                retry_5s_delay_ms: self.consumer_retry_5s_delay_ms,
                retry_1m_delay_ms: self.consumer_retry_1m_delay_ms,
                max_attempts: self.consumer_max_attempts,
            },
            writer_epoch: Some(self.region_epoch),
            labels: self.trace_labels(),
        })
    }

    /// The region and purchase cell every span and log line of this process's roles carries.
    pub fn trace_labels(&self) -> boxoffice_trace::Labels {
        boxoffice_trace::Labels { region: self.region.clone(), purchase_cell: self.purchase_cell.clone() }
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
            redis_url: self.redis_url.clone(),
            key_prefix: self.redis_key_prefix.clone(),
            timeout_ms: self.redis_timeout_ms,
            queue_timeout_ms: self.redis_queue_timeout_ms,
            abandon_after_ms: self.waitroom_abandon_after_ms,
            slot_ms: self.admission_ttl_s as u64 * 1_000,
            max_positions_per_user: self.waitroom_max_positions_per_user,
            ..Default::default()
        }
    }

    /// The bounds of the buyers' live order streams.
    pub fn order_streams(&self) -> boxoffice_api::order_stream::StreamSettings {
        boxoffice_api::order_stream::StreamSettings {
            max_per_user: self.order_stream_max_per_user,
            max_per_ip: self.order_stream_max_per_ip,
            max_streams: self.order_stream_max,
            heartbeat: std::time::Duration::from_secs(self.order_stream_heartbeat_s),
            max_lifetime: std::time::Duration::from_secs(self.order_stream_max_lifetime_s),
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
        let opts: sqlx::postgres::PgConnectOptions =
            self.database_url.expose_secret().parse().context("invalid database_url")?;
        // Names the cell in pg_stat_activity (which cell's process holds a connection).
        let mut opts = opts
            .application_name(&format!("boxoffice-{}", self.purchase_cell))
            .options([("plan_cache_mode", self.db_plan_cache_mode.as_str())]);
        if self.db_statement_timeout_ms > 0 {
            let t = self.db_statement_timeout_ms.to_string();
            opts = opts.options([
                ("statement_timeout", t.as_str()),
                ("idle_in_transaction_session_timeout", t.as_str()),
            ]);
        }
        Ok(boxoffice_store::region::writer_options(opts, &self.writer()))
    }

    /// This deployment's region writer identity.
    pub fn writer(&self) -> boxoffice_store::region::Writer {
        boxoffice_store::region::Writer { region: self.region.clone(), epoch: self.region_epoch }
    }
}

/// The database a URL names, as (host in lower case, port, database): two URLs that differ in
/// their parameters name the same database. Errors name the setting, never the URL. Host
/// aliases (`localhost` and `127.0.0.1`) are not resolved.
fn database_key(url: &SecretString, setting: &str) -> anyhow::Result<(String, u16, String)> {
    let o: sqlx::postgres::PgConnectOptions =
        url.expose_secret().parse().map_err(|_| anyhow::anyhow!("{setting}: not a PostgreSQL URL"))?;
    Ok((o.get_host().to_ascii_lowercase(), o.get_port(), o.get_database().unwrap_or_default().to_owned()))
}

/// A PEM value as given, or the contents of the file it names. Errors name the setting, never
/// the value (a path is not echoed either: it may be a pasted key in another encoding).
fn pem_or_file(value: &str, setting: &str) -> anyhow::Result<String> {
    if value.trim_start().starts_with("-----BEGIN") {
        return Ok(value.to_owned());
    }
    // The value may be a key someone pasted in another encoding: never echo it.
    std::fs::read_to_string(value.trim()).with_context(|| {
        format!("{setting}: neither a PEM key nor a readable key file (the value is not shown)")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The configuration a production deployment would run with: nothing built in.
    fn production() -> Config {
        let key = AdmissionSigningKey::from_seed("prod-1", [42; 32]);
        Config {
            env: Environment::Production,
            user_jwks_url: Some("https://id.example.test/.well-known/jwks.json".into()),
            user_jwt_issuer: Some("https://id.example.test/".into()),
            user_jwt_audience: Some("boxoffice-api".into()),
            admission_kid: "prod-1".into(),
            admission_private_key: key.to_pkcs8_pem().into(),
            stripe_secret_key: "sk_live_0123456789abcdefghijklmnopqrstuv".into(),
            stripe_webhook_secret: "whsec_0123456789abcdefghijklmnopqrstuvwx".into(),
            admin_token: "0123456789abcdef0123456789abcdef-operator".into(),
            webhook_allowed_networks: vec!["3.18.12.63/32".into(), "3.130.192.231/32".into()],
            ..Config::default()
        }
    }

    fn refusal(c: &Config) -> SecretFindings {
        c.validate().expect_err("refused").downcast::<SecretFindings>().expect("a secrets refusal")
    }

    /// The retentions of the inbox and of webhook events with no order id: none short enough
    /// to prune a row whose message or webhook can still be redelivered, none past the
    /// timestamp range the prune computes with.
    #[test]
    fn retentions_outlive_redelivery_and_stay_in_range() {
        let base = Config::default();
        base.validate().unwrap();
        let refused = |c: Config| format!("{:#}", c.validate().expect_err("refused"));
        for bad in [-1, 0, 3 * 86_400, MAX_RETENTION_S + 1, i64::MAX] {
            assert!(refused(Config { webhook_event_retention_s: bad, ..base.clone() })
                .contains("webhook_event_retention_s"));
        }
        for bad in [-1, 0, 3_600, MAX_RETENTION_S + 1] {
            assert!(refused(Config { inbox_retention_s: bad, ..base.clone() }).contains("inbox_retention_s"));
        }
        for good in [boxoffice_store::stripe_events::MIN_UNCLAIMED_RETENTION_S, MAX_RETENTION_S] {
            Config { webhook_event_retention_s: good, inbox_retention_s: good, ..base.clone() }
                .validate()
                .unwrap();
        }
    }

    /// The region settings' rules (design §15): each refusal names its setting.
    #[test]
    fn region_settings_are_checked() {
        let base = Config::default();
        base.validate().unwrap();
        let refused = |c: Config| format!("{:#}", c.validate().expect_err("refused"));
        assert!(refused(Config { region_epoch: 0, ..base.clone() }).contains("region_epoch"));
        assert!(refused(Config { region: "eu west".into(), ..base.clone() }).contains("region"));
        assert!(refused(Config { region_lease_renew_ms: 3_000, ..base.clone() })
            .contains("region_lease_renew_ms"));
        let short = refused(Config { outbox_retention_s: 200, ..base.clone() });
        assert!(
            short.contains("outbox_retention_s") && short.contains("region_max_replication_lag_s"),
            "{short}"
        );
        let witness = Config { witness_database_url: Some("postgres://w/witness".into()), ..base.clone() };
        witness.validate().unwrap();
        assert!(refused(Config { region_lease_skew_ms: 5_000, ..witness.clone() })
            .contains("region_lease_skew_ms"));
        assert!(refused(Config { db_statement_timeout_ms: 0, ..witness.clone() })
            .contains("db_statement_timeout_ms"));
        let same = Config {
            witness_database_url: Some(base.database_url.expose_secret().to_owned().into()),
            ..base.clone()
        };
        assert!(refused(same).contains("witness_database_url"));
        let opts = format!("{:?}", base.pg_options().unwrap());
        assert!(
            opts.contains("boxoffice.region_epoch=1") && opts.contains("statement_timeout=10000"),
            "{opts}"
        );
    }

    #[test]
    fn development_defaults_validate_with_one_warning_per_builtin_secret() {
        let c = Config::default();
        assert_eq!(c.env, Environment::Development);
        c.validate().unwrap();
        let keys: Vec<&str> = c.development_warnings().iter().map(|(k, _)| *k).collect();
        assert_eq!(
            keys,
            [
                "user_jwt_secret",
                "admission_private_key",
                "stripe_secret_key",
                "stripe_webhook_secret",
                "admin_token"
            ]
        );
        assert!(production().development_warnings().is_empty());
        let replaced = Config { env: Environment::Development, ..production() };
        let keys: Vec<&str> = replaced.development_warnings().iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, ["user_jwt_secret"], "only the HS256 secret is still built in");
    }

    #[test]
    fn production_refuses_every_builtin_secret_by_name_without_printing_any() {
        let c = Config { env: Environment::Production, ..Config::default() };
        let r = refusal(&c);
        assert_eq!(
            r.keys(),
            [
                "user_jwks_url",
                "user_jwt_issuer",
                "user_jwt_audience",
                "admission_private_key",
                "stripe_secret_key",
                "stripe_webhook_secret",
                "admin_token",
                "webhook_allowed_networks"
            ]
        );
        let msg = format!("{:#}", anyhow::Error::from(r));
        for secret in [
            DEV_USER_JWT_SECRET,
            DEV_STRIPE_SECRET_KEY,
            DEV_WEBHOOK_SECRETS[0],
            DEV_ADMIN_TOKEN,
            "PRIVATE KEY",
            &AdmissionSigningKey::dev().to_pkcs8_pem(),
        ] {
            assert!(!msg.contains(secret), "{msg}");
        }
        for stated in ["shorter than 32 characters", "a test key", "https://api.stripe.com", "BOXOFFICE_ENV"]
        {
            assert!(msg.contains(stated), "{stated}: {msg}");
        }
        production().validate().unwrap();
        let bypass = Config { admission_direct: true, ..production() };
        assert_eq!(refusal(&bypass).keys(), ["admission_direct"], "the queue bypass is development only");
    }

    #[test]
    fn each_weak_production_setting_is_named_alone() {
        let dev_public = AdmissionSigningKey::dev().verifying_key().to_pem();
        let cases: Vec<(&str, Config)> = vec![
            (
                "stripe_secret_key",
                Config {
                    stripe_secret_key: "sk_test_0123456789abcdefghijklmnopqrstuv".into(),
                    ..production()
                },
            ),
            ("stripe_secret_key", Config { stripe_secret_key: "sk_live_short".into(), ..production() }),
            ("stripe_webhook_secret", Config { stripe_webhook_secret: "whsec_short".into(), ..production() }),
            (
                "stripe_webhook_secret",
                Config { stripe_webhook_secret: DEV_WEBHOOK_SECRETS[1].into(), ..production() },
            ),
            (
                "admission_private_key",
                Config {
                    admission_kid: boxoffice_admission::DEV_KID.into(),
                    admission_private_key: AdmissionSigningKey::dev().to_pkcs8_pem().into(),
                    ..production()
                },
            ),
            (
                "admission_public_keys",
                Config {
                    admission_public_keys: vec![AdmissionPublicKey {
                        kid: "old".into(),
                        public_key: dev_public,
                    }],
                    ..production()
                },
            ),
            (
                "user_jwks_url",
                Config { user_jwks_url: Some("http://id.example.test/jwks.json".into()), ..production() },
            ),
            ("user_jwks_url", Config { user_jwks_url: None, ..production() }),
            ("user_jwt_issuer", Config { user_jwt_issuer: Some(String::new()), ..production() }),
            ("user_jwt_audience", Config { user_jwt_audience: None, ..production() }),
            ("webhook_allowed_networks", Config { webhook_allowed_networks: Vec::new(), ..production() }),
            ("admin_token", Config { admin_token: DEV_ADMIN_TOKEN.into(), ..production() }),
            ("admin_token", Config { admin_token: "short-operator-token".into(), ..production() }),
            (
                "kafka_security_protocol",
                Config {
                    kafka_security_protocol: Some(boxoffice_bus::SecurityProtocol::SaslPlaintext),
                    kafka_sasl_mechanism: Some(boxoffice_bus::SaslMechanism::Plain),
                    kafka_sasl_username: Some("boxoffice".into()),
                    kafka_sasl_password: Some("a-long-kafka-password".into()),
                    ..production()
                },
            ),
            (
                "kafka_sasl_password",
                Config {
                    kafka_security_protocol: Some(boxoffice_bus::SecurityProtocol::SaslSsl),
                    kafka_sasl_mechanism: Some(boxoffice_bus::SaslMechanism::ScramSha512),
                    kafka_sasl_username: Some("boxoffice".into()),
                    kafka_sasl_password: Some("short".into()),
                    ..production()
                },
            ),
        ];
        for (key, c) in cases {
            assert_eq!(refusal(&c).keys(), [key], "{key}");
        }
        // A file instead of a URL is fine; the HS256 secret is not used in production.
        Config {
            user_jwks_url: None,
            user_jwks_file: Some("/etc/boxoffice/jwks.json".into()),
            ..production()
        }
        .validate()
        .unwrap();
        Config { user_jwt_secret: "short".into(), ..production() }.validate().unwrap();
    }

    /// A live key is only ever sent to api.stripe.com, and never runs in development.
    #[test]
    fn a_live_key_is_refused_off_stripe_and_in_development() {
        let sim = Config { stripe_api_base: "http://127.0.0.1:12111".into(), ..production() };
        let r = refusal(&sim);
        assert_eq!(r.keys(), ["stripe_secret_key"]);
        assert!(r.to_string().contains("would be sent to http://127.0.0.1:12111"), "{r}");
        // Stripe's host without TLS would carry the live key in the clear.
        let plain = Config { stripe_api_base: "http://api.stripe.com".into(), ..production() };
        assert_eq!(refusal(&plain).keys(), ["stripe_secret_key"]);
        let dev = Config { env: Environment::Development, ..sim.clone() };
        assert_eq!(refusal(&dev).keys(), ["stripe_secret_key"]);
        let dev_live = Config { env: Environment::Development, ..production() };
        assert!(refusal(&dev_live).to_string().contains("live payments need env = production"));
        // A test key against the simulator is what the drills run with.
        Config { stripe_secret_key: DEV_STRIPE_SECRET_KEY.into(), ..dev }.validate().unwrap();
        // No provider configured: nothing is sent anywhere.
        Config { stripe_api_base: String::new(), ..production() }.validate().unwrap();
    }

    #[test]
    fn a_key_that_is_neither_pem_nor_a_file_is_not_echoed() {
        let pasted = "MC4CAQAwBQYDK2VwBCIEIAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";
        let e = pem_or_file(pasted, "admission_private_key").unwrap_err();
        assert!(!format!("{e:#}").contains(pasted), "{e:#}");
        assert!(format!("{e:#}").contains("admission_private_key"));
    }

    #[test]
    fn kafka_security_settings_fit_together_and_reach_the_clients() {
        use boxoffice_bus::{SaslMechanism, SecurityProtocol};
        let sasl = Config {
            kafka_brokers: Some("kafka-1:9093".into()),
            kafka_security_protocol: Some(SecurityProtocol::SaslSsl),
            kafka_sasl_mechanism: Some(SaslMechanism::ScramSha256),
            kafka_sasl_username: Some("boxoffice".into()),
            kafka_sasl_password: Some("a-long-kafka-password".into()),
            ..production()
        };
        sasl.validate().unwrap();
        let k = sasl.kafka().unwrap();
        assert_eq!(k.security.protocol, Some(SecurityProtocol::SaslSsl));
        let c = k.client_config();
        assert_eq!(c.get("sasl.mechanism"), Some("SCRAM-SHA-256"));
        assert_eq!(c.get("sasl.password"), Some("a-long-kafka-password"));
        let bad = [
            Config { kafka_sasl_password: None, ..sasl.clone() },
            Config { kafka_security_protocol: Some(SecurityProtocol::Ssl), ..sasl.clone() },
            Config { kafka_security_protocol: None, ..sasl.clone() },
            Config { kafka_ssl_ca_location: Some("/nonexistent/ca.pem".into()), ..sasl.clone() },
            Config {
                kafka_security_protocol: Some(SecurityProtocol::Plaintext),
                kafka_ssl_ca_location: Some("/etc/hostname".into()),
                ..Config::default()
            },
        ];
        for c in bad {
            assert!(c.validate().is_err(), "{c:?}");
        }
    }

    /// Every secret of every settings struct derived from the configuration stays out of
    /// `Debug` and of the serialized defaults.
    #[test]
    fn debug_output_contains_no_secret() {
        let secrets = [
            "pg-password-4f2a",
            "redis-password-9c1e",
            "user-jwt-secret-7b3d-0123456789abcdef",
            "sk_live_stripe-key-5e6f-0123456789abcdef",
            "whsec_webhook-secret-8a9b-0123456789abcdef",
            "kafka-password-1d2c-0123",
            "admin-token-3e4f-0123456789abcdef0123",
        ];
        let key = AdmissionSigningKey::from_seed("k", [7; 32]);
        let c = Config {
            database_url: format!("postgres://boxoffice:{}@db:5432/boxoffice", secrets[0]).into(),
            redis_url: format!("redis://:{}@redis:6379", secrets[1]).into(),
            user_jwt_secret: secrets[2].into(),
            stripe_secret_key: secrets[3].into(),
            stripe_webhook_secret: secrets[4].into(),
            kafka_brokers: Some("kafka-1:9093".into()),
            kafka_security_protocol: Some(boxoffice_bus::SecurityProtocol::SaslSsl),
            kafka_sasl_mechanism: Some(boxoffice_bus::SaslMechanism::ScramSha512),
            kafka_sasl_username: Some("boxoffice".into()),
            kafka_sasl_password: Some(secrets[5].into()),
            admission_kid: "k".into(),
            admission_private_key: key.to_pkcs8_pem().into(),
            admin_token: secrets[6].into(),
            ..production()
        };
        c.validate().unwrap();
        let api = boxoffice_api::ApiSettings {
            webhook_secret: c.stripe_webhook_secret.clone(),
            admin_token: c.admin_token.clone(),
            ..boxoffice_api::ApiSettings::default()
        };
        let outputs = [
            format!("{c:?}"),
            format!("{:?}", c.kafka().unwrap()),
            format!("{:?}", c.waitroom()),
            format!("{:?}", c.stripe().unwrap()),
            format!("{api:?}"),
            format!("{:?}", crate::runtime::user_tokens(&c)),
            serde_json::to_string(&c).unwrap(),
        ];
        for out in &outputs {
            for secret in secrets.iter().copied().chain([key.to_pkcs8_pem().as_str(), "PRIVATE KEY"]) {
                assert!(!out.contains(secret), "{secret} in {out}");
            }
        }
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
    fn cells_are_distinct_and_a_cell_process_keeps_only_its_own_database() {
        let cell = |name: &str, db: &str, topics: &str, keys: &str| CellSettings {
            name: name.into(),
            database_url: format!("postgres://h/{db}").into(),
            kafka_topic_prefix: topics.into(),
            redis_key_prefix: keys.into(),
            api_url: None,
        };
        let ok = Config {
            cells: vec![cell("cell-1", "a", "c1.", "c1:"), cell("cell-2", "b", "c2.", "c2:")],
            control_database_url: Some("postgres://h/control".into()),
            ..Config::default()
        };
        ok.validate().unwrap();
        let two = ok.for_cell("cell-2").unwrap();
        assert_eq!(two.database_url.expose_secret(), "postgres://h/b");
        assert_eq!((two.kafka_topic_prefix.as_str(), two.redis_key_prefix.as_str()), ("c2.", "c2:"));
        assert_eq!(two.purchase_cell, "cell-2");
        assert!(two.cells.is_empty() && two.control_database_url.is_none());
        assert!(!format!("{two:?}").contains("postgres://h/a"));
        assert!(ok.for_cell("cell-9").is_err());
        let bad = [
            vec![cell("cell-1", "a", "c1.", "c1:"), cell("cell-1", "b", "c2.", "c2:")],
            vec![cell("cell-1", "a", "c1.", "c1:"), cell("cell-2", "a", "c2.", "c2:")],
            vec![cell("cell-1", "a", "c1.", "c1:"), cell("cell-2", "b", "c1.", "c2:")],
            vec![cell("cell-1", "a", "c1.", "c1:"), cell("cell-2", "b", "c2.", "c1:")],
            vec![cell("cell 1", "a", "c1.", "c1:")],
            vec![cell("cell-1", "control", "c1.", "c1:")],
            vec![cell("cell-1", "a", "c1.", "c1:"), cell("cell-2", "a?application_name=x", "c2.", "c2:")],
        ];
        for cells in bad {
            let c = Config { cells, ..ok.clone() };
            assert!(c.validate().is_err(), "{:?}", c.cell_names());
        }
        // In production, the router's hops are set and the cells trust one more.
        let prod = Config {
            cells: ok.cells.clone(),
            control_database_url: ok.control_database_url.clone(),
            ..production()
        };
        for (router, cells, valid) in [
            (None, 1, false),
            (Some(1), 1, false),
            (Some(0), 2, false),
            (Some(0), 1, true),
            (Some(1), 2, true),
        ] {
            let c =
                Config { router_trusted_proxy_hops: router, http_trusted_proxy_hops: cells, ..prod.clone() };
            assert_eq!(c.validate().is_ok(), valid, "router {router:?}, cells {cells}");
        }
        let dev = Config { http_trusted_proxy_hops: 1, ..ok.clone() };
        assert_eq!(dev.router_proxy_hops(), 1, "unset: the router reads http_trusted_proxy_hops");
        assert_eq!(Config { router_trusted_proxy_hops: Some(0), ..dev }.router_proxy_hops(), 0);
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
    fn consumer_fetch_settings_are_bounded() {
        Config { consumer_fetch_min_bytes: 1_048_576, consumer_fetch_wait_ms: 1_000, ..Config::default() }
            .validate()
            .unwrap();
        let bad = [
            Config { consumer_fetch_min_bytes: 0, ..Config::default() },
            Config { consumer_fetch_min_bytes: 1_048_577, ..Config::default() },
            Config { consumer_fetch_wait_ms: 0, ..Config::default() },
            Config { consumer_fetch_wait_ms: 1_001, ..Config::default() },
        ];
        for (c, key) in bad.into_iter().zip(["min_bytes", "min_bytes", "wait_ms", "wait_ms"]) {
            let e = c.validate().expect_err("refused").to_string();
            assert!(e.starts_with(&format!("consumer_fetch_{key} ")), "{e}");
        }
    }

    #[test]
    fn transaction_slots_are_at_most_the_lanes() {
        for n in [0, 1, 8] {
            Config {
                consumer_transactions_max: n,
                consumer_lanes: 8,
                consumer_group_commit: false,
                ..Config::default()
            }
            .validate()
            .unwrap();
        }
        let e = Config {
            consumer_transactions_max: 9,
            consumer_lanes: 8,
            consumer_group_commit: false,
            ..Config::default()
        }
        .validate()
        .expect_err("refused");
        assert!(e.to_string().starts_with("consumer_transactions_max "), "{e}");
    }

    #[test]
    fn group_commit_takes_no_transaction_slots() {
        assert!(!Config::default().consumer_group_commit, "off by default");
        Config::default().validate().unwrap();
        let e = Config { consumer_group_commit: true, consumer_transactions_max: 2, ..Config::default() }
            .validate()
            .expect_err("refused");
        assert!(e.to_string().starts_with("consumer_group_commit "), "{e}");
        for n in [0, 257] {
            let e = Config { consumer_group_commits_max: n, ..Config::default() }
                .validate()
                .expect_err("refused");
            assert!(e.to_string().starts_with("consumer_group_commits_max "), "{e}");
        }
        Config { consumer_group_commits_max: 1, consumer_lanes: 1, ..Config::default() }.validate().unwrap();
    }

    #[test]
    fn the_batch_linger_is_bounded() {
        for ms in [0, 100] {
            Config { consumer_batch_linger_ms: ms, ..Config::default() }.validate().unwrap();
        }
        let e =
            Config { consumer_batch_linger_ms: 101, ..Config::default() }.validate().expect_err("refused");
        assert!(e.to_string().starts_with("consumer_batch_linger_ms "), "{e}");
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
    fn load_applies_defaults_and_the_binarys_environment() {
        let c = Config::load(None, Environment::Development).unwrap();
        assert_eq!(c.env, Environment::Development);
        assert_eq!(c.stripe_webhook_secret.expose_secret(), "whsec_boxoffice_dev");
        assert_eq!(c.kafka_partitions, 12);
        let refused = Config::load(None, Environment::Production).unwrap_err();
        assert!(refused.downcast_ref::<SecretFindings>().is_some(), "{refused:#}");
    }

    #[test]
    fn the_otlp_endpoint_is_off_by_default_and_read_from_the_environment() {
        assert_eq!(Config::default().otlp_endpoint, None);
        for bad in ["", "127.0.0.1:4317", "grpc://collector:4317", "http://", "http://a b"] {
            let c = Config { otlp_endpoint: Some(bad.into()), ..Config::default() };
            assert!(format!("{:#}", c.validate().unwrap_err()).contains("otlp_endpoint"), "{bad:?}");
        }
        // nextest runs every test in its own process: this environment is this test's alone.
        std::env::set_var("BOXOFFICE_OTLP_ENDPOINT", "http://127.0.0.1:4317");
        let c = Config::load(None, Environment::Development).unwrap();
        assert_eq!(c.otlp_endpoint.as_deref(), Some("http://127.0.0.1:4317"));
    }

    #[test]
    fn webhook_networks_are_read_from_the_environment_as_terraform_writes_them() {
        // nextest runs every test in its own process: this environment is this test's alone.
        // infra/main.tf sets WEBHOOK_ALLOWED_NETWORKS = jsonencode(var.webhook_allowed_networks).
        std::env::set_var(
            "BOXOFFICE_WEBHOOK_ALLOWED_NETWORKS",
            r#"["3.18.12.63/32","2600:1f28::/32","54.187.174.169"]"#,
        );
        let c = Config::load(None, Environment::Development).unwrap();
        assert_eq!(c.webhook_allowed_networks, ["3.18.12.63/32", "2600:1f28::/32", "54.187.174.169"]);
        let nets: Vec<String> = c.webhook_networks().unwrap().iter().map(|n| n.to_string()).collect();
        assert_eq!(nets, ["3.18.12.63/32", "2600:1f28::/32", "54.187.174.169/32"]);
        std::env::set_var("BOXOFFICE_WEBHOOK_ALLOWED_NETWORKS", r#"["3.18.12.63/32","stripe.com"]"#);
        let e = format!("{:#}", Config::load(None, Environment::Development).unwrap_err());
        assert!(e.contains("webhook_allowed_networks") && e.contains("stripe.com"), "{e}");
    }

    /// An IPv4-mapped entry allows the IPv4 clients it names: clients are compared by their
    /// canonical address, so left mapped it would match nobody.
    #[test]
    fn ipv4_mapped_webhook_networks_are_read_as_ipv4() {
        let c = Config {
            webhook_allowed_networks: vec![
                "::ffff:3.18.12.63".into(),
                "::ffff:10.1.0.0/112".into(),
                "::ffff:0:0/95".into(),
                "2600:1f28::/32".into(),
            ],
            ..Config::default()
        };
        let nets: Vec<String> = c.webhook_networks().unwrap().iter().map(|n| n.to_string()).collect();
        assert_eq!(nets, ["3.18.12.63/32", "10.1.0.0/16", "::ffff:0.0.0.0/95", "2600:1f28::/32"]);
        let client: std::net::IpAddr = "::ffff:3.18.12.63".parse().unwrap();
        assert!(c.webhook_networks().unwrap()[0].contains(&client.to_canonical()));
    }

    #[test]
    fn secrets_are_read_from_the_environment_verbatim() {
        // nextest runs every test in its own process: this environment is this test's alone.
        let digits = "12345678901234567890123456789012345678";
        let quoted = "\"quoted-user-secret-0123456789abcdef\"";
        std::env::set_var("BOXOFFICE_STRIPE_WEBHOOK_SECRET", digits);
        std::env::set_var("BOXOFFICE_USER_JWT_SECRET", quoted);
        std::env::set_var("BOXOFFICE_REDIS_URL", "true");
        let c = Config::load(None, Environment::Development).unwrap();
        assert_eq!(c.stripe_webhook_secret.expose_secret(), digits);
        assert_eq!(c.user_jwt_secret.expose_secret(), quoted, "quotes are part of the secret");
        assert_eq!(c.redis_url.expose_secret(), "true");
        std::env::set_var("BOXOFFICE_KAFKA_PARTITIONS", "many");
        let e = format!("{:#}", Config::load(None, Environment::Development).unwrap_err());
        assert!(!e.contains(digits) && !e.contains("quoted-user-secret"), "{e}");
    }
}
