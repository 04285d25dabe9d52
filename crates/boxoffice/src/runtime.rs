//! Starts any set of roles in one process, each a long-running task stopped through one
//! `CancellationToken` (SIGTERM / ctrl-c in `serve`): the API finishes in-flight requests,
//! consumers stop after the message in hand (uncommitted offsets replay into the inbox), the
//! relay finishes its batch, and the producer is flushed last.

use crate::config::{Config, Environment};
use anyhow::Context;
use boxoffice_admission::{AdmissionTokens, UserTokens};
use boxoffice_api::{ApiSettings, AppState};
use boxoffice_bus::run_consumers;
use boxoffice_payments::{PaymentGateway, StripeClient, StripeConfig};
use boxoffice_waitroom::Waitroom;
use boxoffice_workers::{expiry, payment::PaymentWorker, relay, release, saga::Saga, tickets::TicketWorker};
use metrics_exporter_prometheus::PrometheusHandle;
use rdkafka::producer::{FutureProducer, Producer};
use secrecy::ExposeSecret;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A role this process can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// HTTP API (waiting room, holds, status, seat map, webhooks, health) and the waiting
    /// room's release controller (one per process; the holder of the cell's advisory lock
    /// releases, the others stand by).
    Api,
    /// Outbox relay.
    Relay,
    /// Saga orchestrator.
    Saga,
    /// Payment worker (Stripe calls).
    Payments,
    /// Hold expiry.
    Expiry,
    /// Ticket issuance.
    Tickets,
    /// The cell router (design §13): forwards buyers to the cell that sells the event, from
    /// the event directory in `control_database_url`, to each cell's `api_url`. Opens no
    /// connection to any cell's database; not in [`Role::ALL`].
    Router,
}

impl Role {
    /// Every role, the default of `serve`.
    pub const ALL: [Role; 6] =
        [Role::Api, Role::Relay, Role::Saga, Role::Payments, Role::Expiry, Role::Tickets];

    /// Whether the role needs a Kafka broker.
    pub fn needs_kafka(self) -> bool {
        matches!(self, Role::Relay | Role::Saga | Role::Payments | Role::Tickets)
    }
}

impl Role {
    /// The role's name on the command line and in logs.
    pub fn name(self) -> &'static str {
        match self {
            Role::Api => "api",
            Role::Relay => "relay",
            Role::Saga => "saga",
            Role::Payments => "payments",
            Role::Expiry => "expiry",
            Role::Tickets => "tickets",
            Role::Router => "router",
        }
    }
}

impl FromStr for Role {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Self> {
        Ok(match s.trim() {
            "api" => Role::Api,
            "relay" => Role::Relay,
            "saga" => Role::Saga,
            "payments" => Role::Payments,
            "expiry" => Role::Expiry,
            "tickets" => Role::Tickets,
            "router" => Role::Router,
            other => {
                anyhow::bail!("unknown role {other:?} (api, relay, saga, payments, expiry, tickets, router)")
            }
        })
    }
}

/// The process-wide Prometheus recorder (installed once).
pub fn metrics_handle() -> Option<PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder().ok())
        .clone()
}

/// Running roles.
pub struct Running {
    /// Where the API listens, when it runs here.
    pub api_addr: Option<SocketAddr>,
    /// Where the router listens, when it runs here.
    pub router_addr: Option<SocketAddr>,
    /// The router's state, when it runs here (its directory map).
    pub router: Option<boxoffice_api::cell_router::CellRouter>,
    tasks: Vec<(&'static str, JoinHandle<()>)>,
    producer: Option<FutureProducer>,
    groups: Vec<Arc<boxoffice_bus::consumer::Assignment>>,
    partitions: i64,
    release: Option<tokio::sync::watch::Receiver<release::Status>>,
    region_lease: Option<Arc<boxoffice_store::region::LeaseGate>>,
}

impl Running {
    /// This process's region lease gate, when a witness is configured.
    pub fn region_lease(&self) -> Option<Arc<boxoffice_store::region::LeaseGate>> {
        self.region_lease.clone()
    }

    /// The release controller's status, when the API role runs here with the controller on.
    pub fn release_status(&self) -> Option<tokio::sync::watch::Receiver<release::Status>> {
        self.release.clone()
    }

    /// Waits until every consumer group run here has all partitions assigned (a new member
    /// takes a few seconds to join); `false` on timeout.
    pub async fn wait_ready(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        while self.groups.iter().any(|g| g.partitions() < self.partitions) {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    /// Waits for every role to stop (after the shutdown token fired), then flushes the
    /// producer.
    pub async fn join(self) {
        for (name, t) in self.tasks {
            if let Err(e) = t.await {
                tracing::error!(role = name, error = %e, "role task ended abnormally");
            }
        }
        if let Some(p) = self.producer {
            let _ = tokio::task::spawn_blocking(move || p.flush(Duration::from_secs(10))).await;
        }
    }
}

/// The Stripe client configured by `cfg`, its calls in flight bounded by
/// `stripe_max_in_flight`; [`start`] builds one per process for all its roles.
pub fn gateway(cfg: &Config) -> anyhow::Result<Arc<dyn PaymentGateway>> {
    Ok(Arc::new(
        StripeClient::new(StripeConfig {
            api_base: cfg.stripe_api_base.clone(),
            secret_key: cfg.stripe_secret_key.clone(),
            timeout_ms: cfg.stripe_timeout_ms,
        })?
        .with_max_in_flight(cfg.stripe_max_in_flight),
    ))
}

/// The pool size of `role`.
fn pool_size(cfg: &Config, role: Role) -> u32 {
    match role {
        Role::Api => cfg.db_pool_api,
        Role::Relay => cfg.db_pool_relay,
        Role::Saga => cfg.db_pool_saga,
        Role::Payments => cfg.db_pool_payments,
        Role::Tickets => cfg.db_pool_tickets,
        Role::Expiry => cfg.db_pool_expiry,
        Role::Router => 0,
    }
}

/// Starts `roles`, each with its own connection pool on `connect`. The API listens on `cfg.http_bind` (port 0 picks a free port;
/// see [`Running::api_addr`]).
pub async fn start(
    cfg: &Config,
    roles: &[Role],
    connect: PgConnectOptions,
    shutdown: CancellationToken,
) -> anyhow::Result<Running> {
    // Inert unless configured; a test may also arm points directly.
    boxoffice_faults::configure(&cfg.faults).map_err(|e| anyhow::anyhow!("faults: {e}"))?;
    // The process's metrics recorder before any role starts, so a series a role registers as
    // it starts (the payment worker's skip reasons at 0) is exported, not dropped.
    let _ = metrics_handle();
    let kafka = cfg.kafka();
    if kafka.is_none() && roles.iter().any(|r| r.needs_kafka()) {
        anyhow::bail!("roles {roles:?} need a Kafka broker: set BOXOFFICE_KAFKA_BROKERS");
    }
    let producer = match &kafka {
        Some(k) => Some(boxoffice_bus::producer::build(k)?),
        None => None,
    };
    let mut tasks: Vec<(&'static str, JoinHandle<()>)> = Vec::new();
    let mut api_addr = None;
    let mut groups = Vec::new();
    let mut release_status = None;
    let consumers = cfg.consumers_per_role;
    let mut router = None;
    let mut router_addr = None;
    let region_lease = match &cfg.witness_database_url {
        Some(url) => {
            let (gate, handle) = start_lease(cfg, url, &connect, shutdown.clone()).await?;
            tasks.push(("lease", handle));
            Some(gate)
        }
        None => None,
    };
    // One Stripe client for every role of the process, so `stripe_max_in_flight` bounds
    // their calls together.
    let provider = match cfg.stripe() {
        Some(_) if roles.iter().any(|r| matches!(r, Role::Api | Role::Payments)) => Some(gateway(cfg)?),
        _ => None,
    };
    for role in roles {
        if *role == Role::Router {
            let (r, addr, handles) = start_router(cfg, shutdown.clone()).await?;
            tasks.extend(handles.into_iter().map(|h| ("router", h)));
            router = Some(r);
            router_addr = Some(addr);
            continue;
        }
        let pool = PgPoolOptions::new()
            .max_connections(pool_size(cfg, *role))
            .acquire_timeout(Duration::from_millis(cfg.db_acquire_timeout_ms))
            .connect_lazy_with(connect.clone());
        match role {
            Role::Api => {
                let webhook_pool = PgPoolOptions::new()
                    .max_connections(cfg.db_pool_webhooks)
                    .acquire_timeout(Duration::from_millis(cfg.db_acquire_timeout_ms))
                    .connect_lazy_with(connect.clone());
                let room = waitroom(cfg)?;
                let state = AppState::new(
                    pool.clone(),
                    webhook_pool,
                    user_verifier(cfg).await?,
                    admission_tokens(cfg)?,
                    room.clone(),
                    ApiSettings {
                        hold_policy: cfg.hold_policy(),
                        authorization_request: cfg.authorization_request(),
                        admission_ttl_s: cfg.admission_ttl_s,
                        webhook_secret: cfg.stripe_webhook_secret.clone(),
                        admission_direct: cfg.admission_direct,
                        // The estimated wait assumes R at its ceiling, where the controller
                        // sits while the ledger is healthy (only the leader knows live R).
                        release_per_s: cfg.release_max_per_s,
                        poll_interval_ms: cfg.waitroom_poll_interval_ms,
                        rate_limits: cfg.rate_limits(),
                        trusted_proxy_hops: cfg.http_trusted_proxy_hops,
                        max_in_flight_per_ip: cfg.http_max_in_flight_per_ip,
                        webhook_max_in_flight_per_ip: cfg.webhook_max_in_flight_per_ip,
                        webhook_batch_max: cfg.webhook_batch_max,
                        queue_max_concurrent: cfg.waitroom_max_concurrent_requests,
                        holds_max_concurrent: cfg.holds_max_concurrent_requests,
                        webhook_timeout: Duration::from_millis(cfg.webhook_timeout_ms),
                        webhook_allowed_networks: cfg.webhook_networks()?,
                        labels: cfg.trace_labels(),
                        admin_token: cfg.admin_token.clone(),
                        admin_max_in_flight_per_ip: cfg.admin_max_in_flight_per_ip,
                        ..ApiSettings::default()
                    },
                    producer.clone(),
                    metrics_handle(),
                )
                .with_region_lease(region_lease.clone())
                .with_order_streams(cfg.order_streams())
                .with_payment_gateway(provider.clone());
                tasks.push((
                    "waitroom-clock",
                    tokio::spawn(room.clone().keep_clock(shutdown.clone().cancelled_owned())),
                ));
                tasks.push((
                    "order-views",
                    tokio::spawn(boxoffice_api::order_stream::read_views(
                        pool.clone(),
                        state.order_streams.clone(),
                        shutdown.clone(),
                    )),
                ));
                tasks.push((
                    "order-notifications",
                    tokio::spawn(boxoffice_api::order_stream::listen(
                        pool.clone(),
                        state.order_streams.clone(),
                        shutdown.clone(),
                    )),
                ));
                let dashboard =
                    boxoffice_api::dashboard::spawn(state.clone(), kafka.clone(), shutdown.clone());
                tasks.push(("dashboard", dashboard));
                tasks.push(("api", spawn_api(state, shutdown.clone(), &mut api_addr, cfg).await?));
                if cfg.release_max_per_s > 0.0 {
                    // Every API process runs one; the cell's advisory lock lets one release.
                    let (controller, status) =
                        release::Controller::new(connect.clone(), room, kafka.as_ref(), cfg.release())?;
                    release_status = Some(status);
                    tasks.push(("release", tokio::spawn(controller.run(shutdown.clone()))));
                }
            }
            Role::Relay => {
                let (pool, producer, k, sd) = (
                    pool.clone(),
                    producer.clone().expect("kafka"),
                    kafka.clone().expect("kafka"),
                    shutdown.clone(),
                );
                let id = format!("relay-{}-{}", std::process::id(), uuid::Uuid::new_v4().simple());
                let settings = relay::RelaySettings {
                    batch: cfg.relay_batch,
                    lease_ms: cfg.relay_lease_ms,
                    refused_retry_s: cfg.relay_refused_retry_s,
                    retention_s: cfg.outbox_retention_s,
                    history_retention_s: cfg.order_history_retention_days.saturating_mul(86_400),
                    ..Default::default()
                };
                let c = connect.clone();
                tasks.push(("relay", tokio::spawn(relay::run(pool, c, producer, k, id, settings, sd))));
            }
            Role::Saga | Role::Payments | Role::Tickets => {
                let (k, p) = (kafka.as_ref().expect("kafka"), producer.clone().expect("kafka"));
                tracing::info!(role = ?role, min_bytes = cfg.consumer_fetch_min_bytes,
                    wait_ms = cfg.consumer_fetch_wait_ms,
                    // What the lanes wait: a batch of one has nothing to wait for.
                    linger_ms = if cfg.consumer_batch_max > 1 { cfg.consumer_batch_linger_ms } else { 0 },
                    transactions_max = cfg.consumer_transactions_max,
                    group_commit = cfg.consumer_group_commit,
                    group_commits_max = cfg.consumer_group_commits_max,
                    "consumers: fetching");
                let members = boxoffice_bus::Members {
                    instances: consumers,
                    lanes: cfg.consumer_lanes,
                    batch: cfg.consumer_batch_max,
                    fetch: boxoffice_bus::Fetch {
                        min_bytes: cfg.consumer_fetch_min_bytes,
                        wait_ms: cfg.consumer_fetch_wait_ms,
                    },
                    linger: std::time::Duration::from_millis(cfg.consumer_batch_linger_ms.into()),
                    transactions: cfg.consumer_transactions_max,
                    group_commit: cfg.consumer_group_commit,
                    group_commits: cfg.consumer_group_commits_max,
                };
                let sd = shutdown.clone();
                let followers = followers(roles, cfg);
                let (handles, assignment) = match role {
                    Role::Saga => {
                        let saga = Saga { capture_request: cfg.capture_request() };
                        run_consumers(k, pool.clone(), Arc::new(saga), p, members, followers, sd)?
                    }
                    Role::Tickets => {
                        run_consumers(k, pool.clone(), Arc::new(TicketWorker), p, members, followers, sd)?
                    }
                    _ => {
                        let worker = Arc::new(
                            PaymentWorker::new(
                                provider.clone().context("the payments role needs stripe_api_base")?,
                                pool.clone(),
                                cfg.hold_policy(),
                            )
                            .in_cell(&cfg.purchase_cell),
                        );
                        run_consumers(k, pool.clone(), worker, p, members, followers, sd)?
                    }
                };
                groups.push(assignment);
                tasks.extend(handles.into_iter().map(|h| (role.name(), h)));
            }
            Role::Router => unreachable!("started above"),
            Role::Expiry => {
                let settings = expiry::ExpirySettings {
                    batch: cfg.expiry_batch,
                    interval_ms: cfg.expiry_interval_ms,
                    capture_deadline_margin_s: cfg.capture_deadline_margin_s,
                    inbox_retention_s: cfg.inbox_retention_s,
                    webhook_event_retention_s: cfg.webhook_event_retention_s,
                };
                tasks.push(("expiry", tokio::spawn(expiry::run(pool.clone(), settings, shutdown.clone()))));
            }
        }
    }
    if let Some(bind) = cfg.metrics_bind.as_deref().filter(|b| !b.is_empty()) {
        tasks.push(("metrics", spawn_metrics(bind, shutdown.clone(), cfg).await?));
    }
    Ok(Running {
        api_addr,
        router_addr,
        router,
        tasks,
        producer,
        groups,
        partitions: cfg.kafka_partitions as i64,
        release: release_status,
        region_lease,
    })
}

/// The region lease renewer (design §15): one renewal before the roles start (a healthy
/// region writes at once; a refused or unreachable witness leaves the gate closed and the
/// process running, answering 503), then one every `region_lease_renew_ms`.
/// The consumers of this process that follow other consumers' facts through in their
/// transactions (`boxoffice_bus::follow`): those of `roles` that make no remote call (the saga
/// and the ticket worker), unless `follow_through` is off.
fn followers(roles: &[Role], cfg: &Config) -> boxoffice_bus::Followers {
    let mut f = boxoffice_bus::Followers::none();
    if !cfg.follow_through {
        return f;
    }
    if roles.contains(&Role::Saga) {
        f = f.with(Arc::new(Saga { capture_request: cfg.capture_request() }));
    }
    if roles.contains(&Role::Tickets) {
        f = f.with(Arc::new(TicketWorker));
    }
    f
}

async fn start_lease(
    cfg: &Config,
    witness_url: &secrecy::SecretString,
    connect: &PgConnectOptions,
    shutdown: CancellationToken,
) -> anyhow::Result<(Arc<boxoffice_store::region::LeaseGate>, JoinHandle<()>)> {
    let witness_opts: PgConnectOptions =
        witness_url.expose_secret().parse().context("witness_database_url: not a PostgreSQL URL")?;
    let timeout = Duration::from_millis(cfg.region_lease_renew_ms.max(100));
    let witness = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(timeout)
        .connect_lazy_with(witness_opts.application_name(&format!("boxoffice-{}-lease", cfg.region)));
    let ledger =
        PgPoolOptions::new().max_connections(1).acquire_timeout(timeout).connect_lazy_with(connect.clone());
    let settings = boxoffice_workers::lease::LeaseSettings {
        holder: format!("{}-{}-{}", cfg.region, std::process::id(), uuid::Uuid::new_v4().simple()),
        writer: cfg.writer(),
        ttl: Duration::from_millis(cfg.region_lease_ttl_ms),
        renew: Duration::from_millis(cfg.region_lease_renew_ms),
    };
    let gate = Arc::new(boxoffice_store::region::LeaseGate::default());
    match boxoffice_workers::lease::renew_once(&witness, &ledger, &gate, &settings).await {
        Ok(r) => tracing::info!(?r, region = %cfg.region, epoch = cfg.region_epoch, "region lease"),
        Err(e) => tracing::warn!(error = %format!("{e:#}"), "first region lease renewal failed"),
    }
    let handle =
        tokio::spawn(boxoffice_workers::lease::run(witness, ledger, gate.clone(), settings, shutdown));
    Ok((gate, handle))
}

async fn spawn_api(
    state: AppState,
    shutdown: CancellationToken,
    addr: &mut Option<SocketAddr>,
    cfg: &Config,
) -> anyhow::Result<JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(&cfg.http_bind)
        .await
        .with_context(|| format!("binding {}", cfg.http_bind))?;
    *addr = Some(listener.local_addr()?);
    let app = boxoffice_api::router(state);
    let edge = cfg.edge();
    Ok(tokio::spawn(async move {
        if let Err(e) = boxoffice_api::serve(listener, app, edge, shutdown).await {
            tracing::error!(error = %e, "api server failed");
        }
    }))
}

/// `/metrics` and `/healthz` on `bind` for a process whose roles serve no HTTP of their own
/// (the workers, the relay): bounded by the same edge (timeouts, connection cap) as the API.
async fn spawn_metrics(
    bind: &str,
    shutdown: CancellationToken,
    cfg: &Config,
) -> anyhow::Result<JoinHandle<()>> {
    let listener =
        tokio::net::TcpListener::bind(bind).await.with_context(|| format!("binding metrics_bind {bind}"))?;
    let handle = metrics_handle();
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move || {
                let handle = handle.clone();
                async move { handle.map(|h| h.render()).unwrap_or_default() }
            }),
        )
        .route("/healthz", axum::routing::get(|| async { "ok" }));
    let edge = cfg.edge();
    Ok(tokio::spawn(async move {
        if let Err(e) = boxoffice_api::serve(listener, app, edge, shutdown).await {
            tracing::error!(error = %e, "metrics server failed");
        }
    }))
}

/// The router role: its directory refresh on the control database and its listener on
/// `router_bind`, bounded by the same edge as the API.
async fn start_router(
    cfg: &Config,
    shutdown: CancellationToken,
) -> anyhow::Result<(boxoffice_api::cell_router::CellRouter, SocketAddr, Vec<JoinHandle<()>>)> {
    let control = cfg.control_database_url.as_ref().context("the router needs control_database_url")?;
    let control: PgConnectOptions =
        control.expose_secret().parse().context("invalid control_database_url")?;
    let control = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy_with(control.application_name("boxoffice-router"));
    let mut cells = std::collections::HashMap::new();
    for c in &cfg.cells {
        let url =
            c.api_url.clone().with_context(|| format!("cells: {} has no api_url for the router", c.name))?;
        cells.insert(c.name.clone(), url);
    }
    if cells.is_empty() {
        anyhow::bail!("the router needs cells with an api_url each");
    }
    // Order streams through the router: cut when the cell has sent nothing for three of its
    // heartbeats (every process of a deployment reads the same `order_stream_heartbeat_s`),
    // and bounded as a cell bounds its own.
    let router = boxoffice_api::cell_router::CellRouter::new(
        cells,
        Duration::from_millis(cfg.router_upstream_timeout_ms),
        boxoffice_api::cell_router::StreamBounds {
            idle: Duration::from_secs(3 * cfg.order_stream_heartbeat_s),
            max: cfg.order_stream_max,
            max_per_ip: cfg.order_stream_max_per_ip,
            trusted_proxy_hops: cfg.router_proxy_hops(),
        },
    )?
    .with_webhook_networks(cfg.webhook_networks()?);
    router.refresh(&control).await;
    let listener = tokio::net::TcpListener::bind(&cfg.router_bind)
        .await
        .with_context(|| format!("binding {}", cfg.router_bind))?;
    let addr = listener.local_addr()?;
    let refresh = tokio::spawn(router.clone().run_refresh(
        control,
        Duration::from_millis(cfg.router_refresh_ms),
        shutdown.clone(),
    ));
    let app = boxoffice_api::cell_router::app(
        router.clone(),
        cfg.http_max_in_flight_per_ip,
        cfg.router_proxy_hops(),
        metrics_handle(),
    );
    tracing::info!(%addr, "router listening");
    let edge = cfg.edge();
    let serve = tokio::spawn(async move {
        if let Err(e) = boxoffice_api::serve(listener, app, edge, shutdown).await {
            tracing::error!(error = %e, "router failed");
        }
    });
    Ok((router, addr, vec![refresh, serve]))
}

/// The admission-token key ring of `cfg` (see [`Config::admission_tokens`]).
pub fn admission_tokens(cfg: &Config) -> anyhow::Result<AdmissionTokens> {
    cfg.admission_tokens()
}

/// The waiting room of `cfg` (connects lazily: a Redis down at start-up is not fatal).
pub fn waitroom(cfg: &Config) -> anyhow::Result<Waitroom> {
    Waitroom::new(cfg.waitroom()).context("invalid redis_url")
}

/// The development bearer-token minter of `cfg`: HS256 with `user_jwt_secret`, tokens
/// carrying the configured issuer and audience (what `boxoffice user-token`, the drills and
/// the tests hand to their buyers). Production verifies with [`user_verifier`] only.
pub fn user_tokens(cfg: &Config) -> UserTokens {
    UserTokens::with(cfg.user_token_policy(), Some(cfg.user_jwt_secret.expose_secret().as_bytes()), None)
}

/// The API's bearer-token verifier: the identity provider's keys when `user_jwks_url` or
/// `user_jwks_file` is set (read once here: the API does not start without them), and the
/// HS256 `user_jwt_secret` in development only.
///
/// # Errors
/// When the key set cannot be read or holds no usable key.
pub async fn user_verifier(cfg: &Config) -> anyhow::Result<UserTokens> {
    let jwks = match cfg.jwks_settings() {
        Some(s) => {
            Some(boxoffice_admission::Jwks::load(s).await.context("loading the identity provider's keys")?)
        }
        None => None,
    };
    let hs256 = (cfg.env == Environment::Development).then(|| cfg.user_jwt_secret.expose_secret().as_bytes());
    Ok(UserTokens::with(cfg.user_token_policy(), hs256, jwks))
}

/// Installs the process's log subscriber on stderr (and span export when `otlp_endpoint` is
/// set): `BOXOFFICE_LOG` (an `EnvFilter`), else `default_filter`; JSON lines when
/// `cfg.log_format` is `json`. See [`crate::telemetry::init`], which also names the roles.
pub fn init_logging(cfg: &Config, default_filter: &str) {
    crate::telemetry::init(cfg, default_filter, &[]);
}
