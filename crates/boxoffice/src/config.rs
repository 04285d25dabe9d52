//! The one typed configuration of every role, loaded once at start-up: defaults (documented
//! on each field) → an optional TOML file (`--config` / `BOXOFFICE_CONFIG`) → `BOXOFFICE_*`
//! environment variables (e.g. `BOXOFFICE_DATABASE_URL`, `BOXOFFICE_KAFKA_BROKERS`,
//! `BOXOFFICE_HOLD_TTL_MS`). Validated before anything starts; secrets are
//! [`secrecy::SecretString`] and never printed (`Debug` redacts them).

use anyhow::{bail, Context};
use figment::providers::{Env, Format, Serialized, Toml};
use figment::Figment;
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// One admission-token key: the first in the list signs, all verify (rotation).
#[derive(Clone, Debug, Deserialize, Serialize)]
pub struct AdmissionKey {
    /// Key id placed in the token header.
    pub kid: String,
    /// HMAC secret.
    #[serde(serialize_with = "redact")]
    pub secret: SecretString,
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
    /// operations; defaults: 20 + 4 + 3 + 9 + 9 + 9 + 2 = 56 for one all-roles process.
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
    /// Kafka bootstrap servers; unset means "none configured" (`onsale` then starts an
    /// embedded broker; `serve` refuses roles that need one).
    pub kafka_brokers: Option<String>,
    /// Prefix of every topic and consumer group name.
    pub kafka_topic_prefix: String,
    /// Partitions of the purchase topic (design §12: ≥ the number of parallel consumers).
    pub kafka_partitions: i32,
    /// Replication factor of created topics.
    pub kafka_replication: i32,
    /// Members per consumer group in one process (each takes a share of the partitions).
    pub consumers_per_role: usize,
    /// Concurrent lanes per member: messages are spread over lanes by order id, so one
    /// order's events stay ordered while different orders are applied in parallel. Each
    /// busy lane holds one database connection.
    pub consumer_lanes: usize,
    /// HTTP listen address of the API role.
    pub http_bind: String,
    /// This deployment's purchase cell (bound into admission tokens).
    pub purchase_cell: String,
    /// HMAC secret verifying buyers' bearer JWTs (dev default; the identity provider's key in
    /// production).
    #[serde(serialize_with = "redact")]
    pub user_jwt_secret: SecretString,
    /// Admission-token keys; the first signs.
    pub admission_keys: Vec<AdmissionKey>,
    /// Admission slot length, seconds.
    pub admission_ttl_s: i64,
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
            http_bind: "127.0.0.1:8080".into(),
            purchase_cell: "cell-1".into(),
            user_jwt_secret: "dev-user-secret-change-me-0123456789".into(),
            admission_keys: vec![AdmissionKey {
                kid: "dev-1".into(),
                secret: "dev-admission-secret-0123456789abcdef".into(),
            }],
            admission_ttl_s: 900,
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
            .merge(Serialized::default(
                "admission_keys",
                d.admission_keys
                    .iter()
                    .map(|k| serde_json::json!({"kid": k.kid, "secret": k.secret.expose_secret()}))
                    .collect::<Vec<_>>(),
            ));
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
        if self.admission_keys.is_empty()
            || self.admission_keys.iter().any(|k| k.secret.expose_secret().len() < 16)
        {
            bail!("admission_keys needs at least one key with a secret of 16+ bytes");
        }
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
        Ok(())
    }

    /// The Kafka settings, if a broker is configured.
    pub fn kafka(&self) -> Option<boxoffice_bus::KafkaConfig> {
        self.kafka_brokers.as_ref().map(|b| boxoffice_bus::KafkaConfig {
            brokers: b.clone(),
            prefix: self.kafka_topic_prefix.clone(),
            partitions: self.kafka_partitions,
            replication: self.kafka_replication,
        })
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
    }

    #[test]
    fn load_applies_defaults() {
        let c = Config::load(None).unwrap();
        assert_eq!(c.stripe_webhook_secret.expose_secret(), "whsec_boxoffice_dev");
        assert_eq!(c.kafka_partitions, 12);
    }
}
