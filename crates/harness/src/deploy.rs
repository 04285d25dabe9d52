//! The in-process deployment the onsale, the bench and the integration tests run against:
//! the Stripe simulator (in-process, unless a running provider is named), the run's Kafka
//! topics (on the configured broker, or on an embedded one), any set of roles started by the
//! product's own [`boxoffice::runtime::start`], and the webhook URL that lets the simulator
//! reach the API those roles expose.
//!
//! Owns the start-up order, because the wiring depends on it: the simulator listens first
//! (the roles' payment gateway needs its address), the topics exist before any consumer
//! joins, and the simulator learns the webhook URL only once the API role has bound its
//! port 0. [`Deployment::start`] returns when every consumer group has its partitions; when a
//! role cannot start or the groups are not ready in time it stops what it started and
//! errors. [`Deployment::stop`] stops the roles and the simulator; a deployment dropped
//! without it keeps running until the tokio runtime ends (as a test's does).

use anyhow::Context;
use boxoffice::config::Config;
use boxoffice::runtime::{self, Role, Running};
use boxoffice_bus::embedded::EmbeddedBroker;
use boxoffice_stripe_sim::{SimConfig, StripeSim};
use sqlx::postgres::PgConnectOptions;
use std::net::SocketAddr;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The simulator configuration matching `cfg`: its webhook signing secret, and only the
/// event types the API handles (as a Stripe webhook endpoint's `enabled_events`). No webhook
/// URL yet.
pub fn sim_config(cfg: &Config) -> SimConfig {
    SimConfig {
        webhook_secret: cfg.stripe_webhook_secret.clone(),
        webhook_events: boxoffice_api::webhooks::HANDLED_EVENTS.iter().map(|s| s.to_string()).collect(),
        ..SimConfig::default()
    }
}

/// Starts an embedded Kafka-protocol broker (librdkafka's mock cluster) when `cfg` names no
/// broker, and points `cfg` at it; `None` when a broker is configured. The broker lives as
/// long as the returned value.
pub fn embedded_broker_unless_configured(cfg: &mut Config) -> anyhow::Result<Option<EmbeddedBroker>> {
    if cfg.kafka_brokers.is_some() {
        return Ok(None);
    }
    let broker = EmbeddedBroker::start(1)?;
    cfg.kafka_brokers = Some(broker.bootstrap_servers());
    Ok(Some(broker))
}

/// Creates every topic of `cfg` (prefix, partitions): on `embedded` when given (the mock
/// cluster does not implement CreateTopics over the wire), else over the wire on
/// `cfg.kafka_brokers`, leaving existing topics alone. Errors when no broker is configured.
pub async fn create_topics(cfg: &Config, embedded: Option<&EmbeddedBroker>) -> anyhow::Result<()> {
    let k = cfg.kafka().context("no Kafka broker configured")?;
    match embedded {
        Some(b) => b.create_topics(&k)?,
        None => {
            boxoffice_bus::topics::create_all(&k).await?;
        }
    }
    Ok(())
}

/// What to start.
pub struct Options<'a> {
    /// The roles.
    pub roles: &'a [Role],
    /// The database the roles use.
    pub db: PgConnectOptions,
    /// A running Stripe (or simulator) to use instead of starting the simulator in-process;
    /// its webhooks are then the caller's business.
    pub stripe_api_base: Option<String>,
    /// The embedded broker `cfg.kafka_brokers` points at, if it is one (topics are created
    /// on it).
    pub embedded: Option<&'a EmbeddedBroker>,
    /// Overrides the simulator's first webhook retry backoff, ms (tests keep it short).
    pub webhook_initial_backoff_ms: Option<u64>,
    /// How long the consumer groups may take to get their partitions.
    pub ready_timeout: Duration,
}

impl<'a> Options<'a> {
    /// `roles` on `db` with an in-process simulator, 60 s to get ready.
    pub fn new(roles: &'a [Role], db: PgConnectOptions) -> Self {
        Self {
            roles,
            db,
            stripe_api_base: None,
            embedded: None,
            webhook_initial_backoff_ms: None,
            ready_timeout: Duration::from_secs(60),
        }
    }
}

/// A running in-process deployment.
pub struct Deployment {
    /// The configuration the roles run with (`stripe_api_base` and `http_bind` as started).
    pub cfg: Config,
    /// The in-process simulator, unless `stripe_api_base` named a running one.
    pub sim: Option<StripeSim>,
    /// Where the API role listens (`None` without it).
    pub api_addr: Option<SocketAddr>,
    /// Cancelled by [`Deployment::stop`]; stops the roles and the simulator.
    pub shutdown: CancellationToken,
    running: Running,
}

impl Deployment {
    /// Starts the simulator (unless `opts.stripe_api_base`), creates the topics when `cfg`
    /// has a broker, starts `opts.roles` with the API on a free loopback port, points the
    /// simulator's webhooks at it and waits until every consumer group has its partitions.
    pub async fn start(mut cfg: Config, opts: Options<'_>) -> anyhow::Result<Self> {
        let shutdown = CancellationToken::new();
        let sim = match opts.stripe_api_base {
            Some(base) => {
                cfg.stripe_api_base = base;
                None
            }
            None => {
                let mut sim_cfg = sim_config(&cfg);
                if let Some(ms) = opts.webhook_initial_backoff_ms {
                    sim_cfg.webhook_initial_backoff_ms = ms;
                }
                let sim = StripeSim::new(sim_cfg);
                let l =
                    tokio::net::TcpListener::bind("127.0.0.1:0").await.context("binding the simulator")?;
                cfg.stripe_api_base = format!("http://{}", l.local_addr()?);
                tokio::spawn(sim.clone().serve(l, shutdown.clone()));
                Some(sim)
            }
        };
        let started = async {
            if cfg.kafka().is_some() {
                create_topics(&cfg, opts.embedded).await?;
            }
            cfg.http_bind = "127.0.0.1:0".into();
            // Every role's session declares the configuration's region epoch, as in
            // production: the ledger's fence checks each purchase write.
            let db = boxoffice_store::region::writer_options(opts.db, &cfg.writer());
            runtime::start(&cfg, opts.roles, db, shutdown.clone()).await
        }
        .await;
        let running = match started {
            Ok(r) => r,
            Err(e) => {
                shutdown.cancel();
                return Err(e);
            }
        };
        if let (Some(sim), Some(addr)) = (&sim, running.api_addr) {
            sim.set_webhook_url(Some(format!("http://{addr}/webhooks/stripe")));
        }
        if !running.wait_ready(opts.ready_timeout).await {
            shutdown.cancel();
            running.join().await;
            anyhow::bail!("consumer groups did not get their partitions");
        }
        Ok(Self { cfg, sim, api_addr: running.api_addr, shutdown, running })
    }

    /// `http://{api_addr}`, when the API role runs.
    pub fn api_url(&self) -> Option<String> {
        self.api_addr.map(|a| format!("http://{a}"))
    }

    /// The release controller's status, when the API role runs it.
    pub fn release_status(&self) -> Option<tokio::sync::watch::Receiver<boxoffice_workers::release::Status>> {
        self.running.release_status()
    }

    /// Stops every role and the simulator, and waits for the roles.
    pub async fn stop(self) {
        self.shutdown.cancel();
        self.running.join().await;
    }
}
