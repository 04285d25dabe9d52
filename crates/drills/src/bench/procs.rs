//! P3's processes and counters: the product runs as a `boxoffice serve` process of its own
//! (every role), the Stripe simulator as a `boxoffice-drills stripe-sim` process and the
//! broker as a `nisshi` process, apart from the bench's process (the load generator), so
//! the CPU of each can be read from `/proc` and charged to the product, to PostgreSQL or to
//! the harness, and within the harness to the generator, the simulator or the broker
//! ([`ProcessCpu`]). [`PgCounters`] reads what PostgreSQL did for the bench's
//! database: transactions (`pg_stat_database`) and, when the server loads
//! `pg_stat_statements`, statements and round trips.
//!
//! Every child is started with [`crate::chaos::only_stdio`] (SIGKILLed if the bench dies, no
//! inherited descriptors) and `kill_on_drop`, its output in a log file under the run
//! directory; [`P3Processes::stop`] sends SIGTERM and waits, so the product drains its
//! in-flight work the way a deployment's stop does. A child's environment is an allow-list
//! ([`inherited_env`]): no variable of the bench's shell reaches it unless it is needed, and no
//! boxoffice setting or secret reaches the broker.

use anyhow::Context;
use boxoffice::config::Config;
use secrecy::ExposeSecret;
use serde::Serialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

/// Where the three programs of P3 come from.
#[derive(Debug, Clone)]
pub struct Programs {
    /// The bench's configuration file, as given, which the product and the simulator are
    /// started with (in the bench's directory); the `BOXOFFICE_*` variables P3 sets override
    /// it, as they override any file. The children read it again when P3 starts.
    pub config: Option<PathBuf>,
    /// The product binary (`boxoffice`).
    pub boxoffice: PathBuf,
    /// The drills binary, for `stripe-sim`.
    pub drills: PathBuf,
    /// The broker (`nisshi`), when no broker is configured and one was found.
    pub nisshi: Option<PathBuf>,
}

/// The processes P3 starts, each of which its CPU is counted for ([`Pids`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    /// `boxoffice serve`, every role.
    Product,
    /// `boxoffice-drills stripe-sim`.
    Simulator,
    /// A `nisshi` broker.
    Broker,
}

impl Part {
    /// The name in messages and of the log file (`<name>.log`).
    fn name(self) -> &'static str {
        match self {
            Part::Product => "product",
            Part::Simulator => "stripe-sim",
            Part::Broker => "broker",
        }
    }
}

/// A started child: what it is, its process and its log file.
struct Proc {
    part: Part,
    child: Child,
    log: PathBuf,
}

/// The processes of one P3 run.
pub struct P3Processes {
    procs: Vec<Proc>,
    /// Where the API listens.
    pub api_addr: SocketAddr,
    /// The simulator's base URL.
    pub sim_base: String,
}

/// Which processes' CPU is whose.
#[derive(Debug, Clone, Default)]
pub struct Pids {
    /// The product (`boxoffice serve`).
    pub product: Vec<u32>,
    /// The Stripe simulator (`boxoffice-drills stripe-sim`).
    pub simulator: Vec<u32>,
    /// The broker, when the bench started one (`nisshi`).
    pub broker: Vec<u32>,
}

/// Starts `program` with `args`, its output in `<dir>/<name>.log`, an environment of
/// [`inherited_env`] (with the bench's `BOXOFFICE_*` variables only when `configured`) plus
/// `env`, in `cwd` when given (else the bench's own directory, so that relative paths in the
/// configuration name the same files for the child as for the bench).
fn spawn(
    part: Part,
    program: &Path,
    args: &[std::ffi::OsString],
    env: &[(String, String)],
    dir: &Path,
    cwd: Option<&Path>,
    configured: bool,
) -> anyhow::Result<Proc> {
    let name = part.name();
    let log = dir.join(format!("{name}.log"));
    let out = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env_clear()
        .envs(inherited_env(configured))
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(std::process::Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .kill_on_drop(true);
    if let Some(cwd) = cwd {
        cmd.current_dir(cwd);
    }
    crate::chaos::only_stdio(cmd.as_std_mut(), true);
    let child = cmd.spawn().with_context(|| format!("starting {name} ({})", program.display()))?;
    Ok(Proc { part, child, log })
}

/// What a child takes from the bench's environment: what a process needs to run, log, trust
/// certificates, reach a proxy and export spans ([`INHERITED_VARS`], [`INHERITED_PREFIXES`]),
/// and, for the children that read boxoffice's configuration (`configured`: the product and
/// the simulator), the `BOXOFFICE_*` variables. Nothing else: the bench may run in a shell
/// holding credentials of unrelated tools, and the broker gets no boxoffice setting or secret.
/// `BOXOFFICE_CONFIG` is never passed: the children that read the file are given it as
/// `--config`.
fn inherited_env(configured: bool) -> Vec<(String, String)> {
    std::env::vars().filter(|(k, _)| inherited(k, configured)).collect()
}

/// Variables every child inherits.
const INHERITED_VARS: [&str; 14] = [
    "PATH",
    "HOME",
    "TMPDIR",
    "TZ",
    "LANG",
    "RUST_BACKTRACE",
    "TOKIO_WORKER_THREADS",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "https_proxy",
    "no_proxy",
];

/// Prefixes of variables every child inherits: the locale and OpenTelemetry's SDK settings
/// (`OTEL_BSP_*`, `OTEL_EXPORTER_OTLP_HEADERS`, …).
const INHERITED_PREFIXES: [&str; 2] = ["LC_", "OTEL_"];

/// Whether a child inherits variable `name` (see [`inherited_env`]). `RUST_LOG` reaches
/// only the product and the simulator (whose logging `BOXOFFICE_LOG` sets): the broker reads
/// it too, and a shell's `RUST_LOG=info` makes it log every request it serves (tens of GB
/// in a P3 run, and a core of CPU charged to the harness).
fn inherited(name: &str, configured: bool) -> bool {
    INHERITED_VARS.contains(&name)
        || INHERITED_PREFIXES.iter().any(|p| name.starts_with(p))
        || (configured
            && (name == "RUST_LOG" || (name.starts_with("BOXOFFICE_") && name != "BOXOFFICE_CONFIG")))
}

fn tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

impl P3Processes {
    /// Starts the broker (when `programs.nisshi` is given: `cfg.kafka_brokers` is pointed at
    /// it), the simulator and one `boxoffice serve` with every role on `db_url`, creates the
    /// topics, and returns once the API answers `/readyz` and every consumer group of the
    /// product has all its partitions (`boxoffice_consumer_assigned_partitions` on `/metrics`).
    /// `embedded`: the in-process broker `cfg` points at, if that is the broker.
    pub async fn start(
        cfg: &mut Config,
        programs: &Programs,
        db_url: &str,
        embedded: Option<&boxoffice_bus::embedded::EmbeddedBroker>,
        dir: &Path,
    ) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut procs = Vec::new();
        if let Some(nisshi) = &programs.nisshi {
            let addr = format!("127.0.0.1:{}", crate::chaos::free_port()?);
            let url = format!("tcp://{addr}");
            let args = [
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
                "--storage-engine",
                "memory://nisshi/",
            ]
            .map(std::ffi::OsString::from);
            // In P3's directory: the broker keeps its state files where it runs.
            procs.push(spawn(Part::Broker, nisshi, &args, &[], dir, Some(dir), false)?);
            let sock: SocketAddr = addr.parse()?;
            anyhow::ensure!(
                crate::chaos::wait_until(Duration::from_secs(30), || crate::chaos::port_open(sock)).await,
                "the broker did not open {addr}: {}",
                tail(&procs[0].log)
            );
            cfg.kafka_brokers = Some(addr);
        }
        let mut created = Err(anyhow::anyhow!("not tried"));
        for _ in 0..20 {
            created = boxoffice_harness::deploy::create_topics(cfg, embedded).await;
            if created.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        created.context("creating the topics")?;

        let api_addr: SocketAddr = format!("127.0.0.1:{}", crate::chaos::free_port()?).parse()?;
        let sim_addr: SocketAddr = format!("127.0.0.1:{}", crate::chaos::free_port()?).parse()?;
        let sim_base = format!("http://{sim_addr}");
        let secrets = secret_env(cfg);
        // The bench's file, as given: the product and the simulator run in the bench's
        // directory, so a relative path names the same file.
        let config: Vec<std::ffi::OsString> = match &programs.config {
            Some(file) => vec!["--config".into(), file.clone().into_os_string()],
            None => Vec::new(),
        };
        let mut sim_args = config.clone();
        sim_args.extend(
            [
                "stripe-sim",
                "--bind",
                &sim_addr.to_string(),
                "--webhook-url",
                &format!("http://{api_addr}/webhooks/stripe"),
            ]
            .map(std::ffi::OsString::from),
        );
        procs.push(spawn(Part::Simulator, &programs.drills, &sim_args, &secrets, dir, None, true)?);
        cfg.stripe_api_base = sim_base.clone();
        cfg.http_bind = api_addr.to_string();
        let mut env = product_env(cfg, db_url);
        env.extend(secrets);
        let mut args = config;
        args.push("serve".into());
        procs.push(spawn(Part::Product, &programs.boxoffice, &args, &env, dir, None, true)?);
        let mut me = Self { procs, api_addr, sim_base };
        if let Err(e) = me.ready(cfg).await {
            let logs: Vec<String> =
                me.procs.iter().map(|p| format!("--- {} ---\n{}", p.part.name(), tail(&p.log))).collect();
            me.stop().await;
            return Err(e.context(logs.join("\n")));
        }
        Ok(me)
    }

    async fn ready(&mut self, cfg: &Config) -> anyhow::Result<()> {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(5)).build()?;
        let deadline = Instant::now() + Duration::from_secs(90);
        let want = cfg.kafka_partitions as f64;
        loop {
            for p in &mut self.procs {
                if let Ok(Some(status)) = p.child.try_wait() {
                    anyhow::bail!("{} exited during start-up ({status})", p.part.name());
                }
            }
            let sim = http
                .get(format!("{}/_sim/stats", self.sim_base))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            let api = http
                .get(format!("http://{}/readyz", self.api_addr))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            let assigned = match http.get(format!("http://{}/metrics", self.api_addr)).send().await {
                Ok(r) => assigned_partitions(&r.text().await.unwrap_or_default()),
                Err(_) => Vec::new(),
            };
            let groups = boxoffice_domain::consumers::ALL;
            let all_assigned =
                groups.iter().all(|g| assigned.iter().any(|(name, n)| name == g && *n >= want));
            if sim && api && all_assigned {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "not ready within 90 s (simulator {sim}, api {api}, consumer partitions {assigned:?})"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The pids, for CPU accounting.
    pub fn pids(&self) -> Pids {
        let mut pids = Pids::default();
        for p in &self.procs {
            let Some(id) = p.child.id() else { continue };
            match p.part {
                Part::Product => pids.product.push(id),
                Part::Broker => pids.broker.push(id),
                Part::Simulator => pids.simulator.push(id),
            }
        }
        pids
    }

    /// SIGTERM to the product first (it finishes in-flight work), then the others; waits up
    /// to 30 s for each before SIGKILL.
    pub async fn stop(mut self) {
        self.procs.sort_by_key(|p| if p.part == Part::Product { 0 } else { 1 });
        for p in &mut self.procs {
            if let Some(pid) = p.child.id() {
                // SAFETY: plain kill(2) on our own child's pid.
                unsafe {
                    libc::kill(pid as i32, libc::SIGTERM);
                }
            }
            if tokio::time::timeout(Duration::from_secs(30), p.child.wait()).await.is_err() {
                let _ = p.child.kill().await;
            }
        }
    }
}

/// `(consumer, partitions)` from the product's `boxoffice_consumer_assigned_partitions` lines.
fn assigned_partitions(metrics: &str) -> Vec<(String, f64)> {
    metrics
        .lines()
        .filter(|l| l.starts_with("boxoffice_consumer_assigned_partitions{"))
        .filter_map(|l| {
            let name = l.split("consumer=\"").nth(1)?.split('"').next()?.to_owned();
            let value = l.rsplit(' ').next()?.parse().ok()?;
            Some((name, value))
        })
        .collect()
}

/// The secrets the children share with the bench, as `BOXOFFICE_*` variables: the chaos
/// drill's set and the Redis URL (which may carry a password).
fn secret_env(cfg: &Config) -> Vec<(String, String)> {
    let mut env = crate::chaos::secret_env(cfg);
    env.push(("BOXOFFICE_REDIS_URL".into(), cfg.redis_url.expose_secret().to_owned()));
    env
}

/// What the product process is told besides the bench's own `BOXOFFICE_*` environment, which
/// it inherits: the settings P3 changes for its run (see `p3::run_on`).
fn product_env(cfg: &Config, db_url: &str) -> Vec<(String, String)> {
    let mut env: Vec<(&str, String)> = vec![
        ("BOXOFFICE_ENV", cfg.env.as_str().to_owned()),
        ("BOXOFFICE_DATABASE_URL", db_url.to_owned()),
        ("BOXOFFICE_HTTP_BIND", cfg.http_bind.clone()),
        ("BOXOFFICE_STRIPE_API_BASE", cfg.stripe_api_base.clone()),
        ("BOXOFFICE_KAFKA_TOPIC_PREFIX", cfg.kafka_topic_prefix.clone()),
        ("BOXOFFICE_KAFKA_PARTITIONS", cfg.kafka_partitions.to_string()),
        ("BOXOFFICE_REDIS_KEY_PREFIX", cfg.redis_key_prefix.clone()),
        ("BOXOFFICE_ADMISSION_DIRECT", cfg.admission_direct.to_string()),
        ("BOXOFFICE_RELEASE_MAX_PER_S", cfg.release_max_per_s.to_string()),
        ("BOXOFFICE_RATE_LIMIT_IP_PER_S", cfg.rate_limit_ip_per_s.to_string()),
        ("BOXOFFICE_RATE_LIMIT_USER_PER_S", cfg.rate_limit_user_per_s.to_string()),
        ("BOXOFFICE_RATE_LIMIT_PURCHASE_IP_PER_S", cfg.rate_limit_purchase_ip_per_s.to_string()),
        ("BOXOFFICE_RATE_LIMIT_PURCHASE_USER_PER_S", cfg.rate_limit_purchase_user_per_s.to_string()),
        ("BOXOFFICE_RATE_LIMIT_SEATS_IP_PER_S", cfg.rate_limit_seats_ip_per_s.to_string()),
        ("BOXOFFICE_HTTP_MAX_IN_FLIGHT_PER_IP", cfg.http_max_in_flight_per_ip.to_string()),
        ("BOXOFFICE_WEBHOOK_MAX_IN_FLIGHT_PER_IP", cfg.webhook_max_in_flight_per_ip.to_string()),
        ("BOXOFFICE_HOLD_TTL_MS", cfg.hold_ttl_ms.to_string()),
        ("BOXOFFICE_ORDER_STREAM_MAX_PER_IP", cfg.order_stream_max_per_ip.to_string()),
    ];
    if let Some(b) = &cfg.kafka_brokers {
        env.push(("BOXOFFICE_KAFKA_BROKERS", b.clone()));
    }
    env.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
}

/// CPU used by the product, PostgreSQL, the harness (this process plus the simulator and the
/// broker) and everything else over a window.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct ProcessCpu {
    /// Window length, seconds.
    pub seconds: f64,
    /// Share of all cores busy (not idle or waiting for IO), percent.
    pub machine_busy_pct: f64,
    /// Cores used by the `boxoffice serve` process (every role).
    pub product_cores: f64,
    /// Cores used by PostgreSQL processes (every database of the server).
    pub postgres_cores: f64,
    /// Cores used by the load generator (this process), the simulator and the broker: the sum
    /// of the three below.
    pub harness_cores: f64,
    /// Cores used by the load generator: this process, which also samples the run (outbox
    /// age, consumer lag, PostgreSQL's counters), runs the `VACUUM (ANALYZE)` of a server
    /// without autovacuum, and runs the broker when it is the in-process one.
    pub generator_cores: f64,
    /// Cores used by the Stripe simulator's process.
    pub simulator_cores: f64,
    /// Cores used by the broker's process when the bench started one (`nisshi`); 0 with the
    /// in-process broker (its CPU is the generator's) or an external one (its CPU counts as
    /// other).
    pub broker_cores: f64,
    /// Cores used by everything else (Redis, other work on the machine, an external broker).
    pub other_cores: f64,
}

/// Counters at one instant, clock ticks.
#[derive(Debug, Clone)]
pub struct CpuMark {
    at: Instant,
    product: u64,
    simulator: u64,
    broker: u64,
    base: super::CpuSnap,
}

impl CpuMark {
    /// Reads the counters of `pids` (and this process) now.
    pub fn now(pids: &Pids) -> Self {
        let sum = |ids: &[u32]| -> u64 {
            ids.iter().filter_map(|p| super::proc_ticks(&format!("/proc/{p}/stat")).map(|t| t.1)).sum()
        };
        Self {
            at: Instant::now(),
            product: sum(&pids.product),
            simulator: sum(&pids.simulator),
            broker: sum(&pids.broker),
            base: super::CpuSnap::now(),
        }
    }

    /// The use between `self` and `later`.
    pub fn until(&self, later: &CpuMark) -> ProcessCpu {
        let seconds = (later.at - self.at).as_secs_f64().max(1e-3);
        let cores = |a: u64, b: u64| b.saturating_sub(a) as f64 / super::TICKS_PER_S / seconds;
        let base = self.base.until(&later.base);
        let product = cores(self.product, later.product);
        let simulator = cores(self.simulator, later.simulator);
        let broker = cores(self.broker, later.broker);
        let harness = base.boxoffice_cores + simulator + broker;
        let busy = base.machine_busy_pct / 100.0 * cores_of_machine();
        ProcessCpu {
            seconds,
            machine_busy_pct: base.machine_busy_pct,
            product_cores: product,
            postgres_cores: base.postgres_cores,
            harness_cores: harness,
            generator_cores: base.boxoffice_cores,
            simulator_cores: simulator,
            broker_cores: broker,
            other_cores: (busy - product - harness - base.postgres_cores).max(0.0),
        }
    }
}

impl ProcessCpu {
    /// `cores` of this window spread over `orders` (> 0): CPU milliseconds per order.
    fn ms_per_order(&self, cores: f64, orders: i64) -> f64 {
        cores * self.seconds * 1_000.0 / orders as f64
    }
}

fn cores_of_machine() -> f64 {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) as f64
}

/// CPU-ms per second, by whom: a window's cores × 1,000.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct CpuMsPerSecond {
    /// The `boxoffice serve` process: every role.
    pub product: f64,
    /// PostgreSQL (every database of the server).
    pub postgres: f64,
    /// The load generator, the Stripe simulator and the broker.
    pub harness: f64,
    /// Of `harness`, the broker the bench started (0 with the in-process broker or an
    /// external one).
    pub broker: f64,
}

impl CpuMsPerSecond {
    /// `cpu`'s cores as CPU-ms per second.
    pub fn of(cpu: &ProcessCpu) -> Self {
        Self {
            product: cpu.product_cores * 1_000.0,
            postgres: cpu.postgres_cores * 1_000.0,
            harness: cpu.harness_cores * 1_000.0,
            broker: cpu.broker_cores * 1_000.0,
        }
    }
}

/// CPU-ms per ticketed order, by whom.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct CpuMsPerOrder {
    /// The `boxoffice serve` process: every role.
    pub product: f64,
    /// PostgreSQL.
    pub postgres: f64,
    /// The load generator, the Stripe simulator and the broker.
    pub harness: f64,
}

/// The harness's CPU-ms per ticketed order, by part (their sum is [`CpuMsPerOrder::harness`]).
/// What the bench's own processes cost beside the product. Part of it is paid per second,
/// not per order (the generator's sampling, an idle consumer's polls at the broker), and the
/// broker's part follows the product's traffic (facts per order, the consumer groups that
/// read them); a deployment pays that part on its brokers' hosts.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct HarnessMsPerOrder {
    /// The load generator (the bench's process; a broker it runs in-process included).
    pub generator: f64,
    /// The Stripe simulator.
    pub simulator: f64,
    /// The broker the bench started; 0 with the in-process broker (counted in `generator`)
    /// or an external one.
    pub broker: f64,
}

impl HarnessMsPerOrder {
    /// `cpu`'s harness parts spread over `orders`; None without orders.
    pub fn of(cpu: &ProcessCpu, orders: i64) -> Option<Self> {
        (orders > 0).then(|| Self {
            generator: cpu.ms_per_order(cpu.generator_cores, orders),
            simulator: cpu.ms_per_order(cpu.simulator_cores, orders),
            broker: cpu.ms_per_order(cpu.broker_cores, orders),
        })
    }
}

impl CpuMsPerOrder {
    /// `cpu` spread over `orders`; None without orders.
    pub fn of(cpu: &ProcessCpu, orders: i64) -> Option<Self> {
        (orders > 0).then(|| Self {
            product: cpu.ms_per_order(cpu.product_cores, orders),
            postgres: cpu.ms_per_order(cpu.postgres_cores, orders),
            harness: cpu.ms_per_order(cpu.harness_cores, orders),
        })
    }
}

/// One statement's share of the window, from `pg_stat_statements`.
#[derive(Debug, Clone, Serialize)]
pub struct StatementCost {
    /// The normalized text, at most 200 characters.
    pub query: String,
    /// Calls per ticketed order.
    pub calls_per_order: f64,
    /// Execution time per ticketed order, ms (server time, not CPU).
    pub exec_ms_per_order: f64,
}

/// What PostgreSQL did for the bench's database over the window, per ticketed order.
#[derive(Debug, Clone, Serialize)]
pub struct PgPerOrder {
    /// Committed and rolled-back transactions (`pg_stat_database`), per ticketed order.
    pub transactions: f64,
    /// Statements other than transaction control (`BEGIN`, `COMMIT`, `ROLLBACK`, savepoints);
    /// None without `pg_stat_statements`.
    pub statements: Option<f64>,
    /// Every call of a client `pg_stat_statements` saw, transaction control included: each is
    /// one round trip (none are pipelined); None without it.
    pub round_trips: Option<f64>,
    /// Execution time of every statement `pg_stat_statements` saw in the bench's database,
    /// ms per ticketed order: the product's, the bench's own (its `VACUUM (ANALYZE)`, its
    /// polls) and the region lease's check at commit. Server time inside the executor, not
    /// CPU: parsing, the protocol and the server's own processes are outside it. None without
    /// `pg_stat_statements`.
    pub exec_ms: Option<f64>,
    /// WAL the whole server wrote over the window (`pg_current_wal_lsn`), bytes per ticketed
    /// order: the purchase path's, the bench's `VACUUM (ANALYZE)`'s or autovacuum's, the
    /// full-page images after a checkpoint, and any other database's on the same server.
    pub wal_bytes: f64,
    /// Statements PostgreSQL ran itself at commit, outside any client statement (the region
    /// lease's deferred check, migrations 0013 and 0018), which `pg_stat_statements` lists as top
    /// level: neither statements nor round trips above.
    pub commit_trigger_statements: Option<f64>,
    /// Why statements are missing, when they are.
    pub statements_unavailable: Option<String>,
    /// The statements with the most calls per order, most first (at most 25).
    pub top: Vec<StatementCost>,
}

/// What PostgreSQL did for the bench's database per second while the product was at rest
/// (every role running, no buyer): the fields of [`PgPerOrder`], per second.
#[derive(Debug, Clone, Serialize)]
pub struct PgAtRest {
    /// Committed and rolled-back transactions per second.
    pub transactions_per_s: f64,
    /// Statements other than transaction control per second; None without `pg_stat_statements`.
    pub statements_per_s: Option<f64>,
    /// Client calls (round trips) per second; None without `pg_stat_statements`.
    pub round_trips_per_s: Option<f64>,
    /// Statement execution time, ms per second (server time, not CPU).
    pub exec_ms_per_s: Option<f64>,
    /// WAL the whole server wrote, bytes per second.
    pub wal_bytes_per_s: f64,
    /// The region lease's commit-time statements per second.
    pub commit_trigger_statements_per_s: Option<f64>,
    /// Why statements are missing, when they are.
    pub statements_unavailable: Option<String>,
    /// The statements with the most calls per second, most first (at most 25).
    pub top: Vec<StatementRate>,
}

/// One statement's calls at rest, from `pg_stat_statements`.
#[derive(Debug, Clone, Serialize)]
pub struct StatementRate {
    /// The normalized text, at most 200 characters.
    pub query: String,
    /// Calls per second.
    pub calls_per_s: f64,
    /// Execution time, ms per second (server time, not CPU).
    pub exec_ms_per_s: f64,
}

/// Counters of the bench database at one instant.
#[derive(Debug, Clone)]
pub struct PgCounters {
    xacts: i64,
    wal_lsn: i64,
    statements: Result<std::collections::HashMap<i64, (String, i64, f64)>, String>,
}

impl PgCounters {
    /// Enables `pg_stat_statements` in the bench's database when the server has it loaded;
    /// the reason otherwise.
    pub async fn enable(pool: &sqlx::PgPool) -> Result<(), String> {
        let loaded: Option<String> = sqlx::query_scalar("SELECT current_setting('shared_preload_libraries')")
            .fetch_optional(pool)
            .await
            .map_err(|e| e.to_string())?;
        if !loaded.unwrap_or_default().split(',').any(|l| l.trim() == "pg_stat_statements") {
            return Err("the server does not load pg_stat_statements (shared_preload_libraries)".into());
        }
        sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .execute(pool)
            .await
            .map_err(|e| e.to_string())?;
        Ok(())
    }

    /// Reads the counters now (`statements` only when `enabled`).
    pub async fn read(pool: &sqlx::PgPool, enabled: bool) -> anyhow::Result<Self> {
        let (xacts, wal_lsn): (i64, i64) = sqlx::query_as(
            "SELECT xact_commit + xact_rollback, (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint
               FROM pg_stat_database WHERE datname = current_database()",
        )
        .fetch_one(pool)
        .await?;
        let statements = if enabled {
            sqlx::query_as::<_, (i64, String, i64, f64)>(
                "SELECT queryid, query, calls, total_exec_time FROM pg_stat_statements
                  WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())",
            )
            .fetch_all(pool)
            .await
            .map(|rows| rows.into_iter().map(|(id, q, c, t)| (id, (q, c, t))).collect())
            .map_err(|e| e.to_string())
        } else {
            Err("pg_stat_statements is not enabled".into())
        };
        Ok(Self { xacts, wal_lsn, statements })
    }

    /// What happened between `self` and `later`, per ticketed order.
    pub fn per_order(&self, later: &PgCounters, orders: i64) -> Option<PgPerOrder> {
        (orders > 0).then(|| self.per(later, orders as f64))
    }

    /// What happened between `self` and `later`, per second of a window of `seconds` (> 0)
    /// in which no buyer arrived.
    pub fn at_rest(&self, later: &PgCounters, seconds: f64) -> PgAtRest {
        let pg = self.per(later, seconds);
        PgAtRest {
            transactions_per_s: pg.transactions,
            statements_per_s: pg.statements,
            round_trips_per_s: pg.round_trips,
            exec_ms_per_s: pg.exec_ms,
            wal_bytes_per_s: pg.wal_bytes,
            commit_trigger_statements_per_s: pg.commit_trigger_statements,
            statements_unavailable: pg.statements_unavailable,
            top: pg
                .top
                .into_iter()
                .map(|t| StatementRate {
                    query: t.query,
                    calls_per_s: t.calls_per_order,
                    exec_ms_per_s: t.exec_ms_per_order,
                })
                .collect(),
        }
    }

    /// The counters' differences divided by `n` (> 0): orders, or seconds.
    fn per(&self, later: &PgCounters, n: f64) -> PgPerOrder {
        let transactions = (later.xacts - self.xacts) as f64 / n;
        let wal_bytes = (later.wal_lsn - self.wal_lsn) as f64 / n;
        let (before, after) = match (&self.statements, &later.statements) {
            (Ok(b), Ok(a)) => (b, a),
            (Err(e), _) | (_, Err(e)) => {
                return PgPerOrder {
                    transactions,
                    statements: None,
                    round_trips: None,
                    exec_ms: None,
                    wal_bytes,
                    commit_trigger_statements: None,
                    statements_unavailable: Some(e.clone()),
                    top: Vec::new(),
                }
            }
        };
        let mut rows: Vec<(String, i64, f64)> = after
            .iter()
            .map(|(id, (q, c, t))| {
                let (c0, t0) = before.get(id).map(|(_, c, t)| (*c, *t)).unwrap_or((0, 0.0));
                (q.clone(), c - c0, t - t0)
            })
            .filter(|r| r.1 > 0)
            .collect();
        rows.sort_by_key(|r| std::cmp::Reverse(r.1));
        let server: i64 = rows.iter().filter(|r| is_commit_trigger(&r.0)).map(|r| r.1).sum();
        let calls: i64 = rows.iter().map(|r| r.1).sum::<i64>() - server;
        let control: i64 = rows.iter().filter(|r| is_transaction_control(&r.0)).map(|r| r.1).sum();
        let top = rows
            .iter()
            .take(25)
            .map(|(q, c, t)| StatementCost {
                query: q.split_whitespace().collect::<Vec<_>>().join(" ").chars().take(200).collect(),
                calls_per_order: *c as f64 / n,
                exec_ms_per_order: t / n,
            })
            .collect();
        PgPerOrder {
            transactions,
            statements: Some((calls - control) as f64 / n),
            round_trips: Some(calls as f64 / n),
            exec_ms: Some(rows.iter().map(|r| r.2).sum::<f64>() / n),
            wal_bytes,
            commit_trigger_statements: Some(server as f64 / n),
            statements_unavailable: None,
            top,
        }
    }
}

/// The statements of `region_lease_commit_check` (migrations 0013 and 0018), which runs when a
/// commit begins and so shows up as a top-level statement: its lease read (since 0018 with the
/// table named by its schema, e.g. `public.region_lease`) and its mark.
const COMMIT_TRIGGER_LEASE_READ: &str = "SELECT required, valid_until FROM ";
const COMMIT_TRIGGER_MARK: &str = "SELECT set_config($1, txid_current()::text, $2)";

/// Whether `q` (normalized by `pg_stat_statements`) is one of the commit-time statements of
/// `region_lease_commit_check`.
pub(crate) fn is_commit_trigger(q: &str) -> bool {
    let q = q.split_whitespace().collect::<Vec<_>>().join(" ");
    if q == COMMIT_TRIGGER_MARK {
        return true;
    }
    let Some(table) = q.strip_prefix(COMMIT_TRIGGER_LEASE_READ) else { return false };
    // `region_lease`, `schema.region_lease` or `"a schema".region_lease` (quote_ident's form).
    table == "region_lease"
        || table.strip_suffix(".region_lease").is_some_and(|schema| {
            let quoted = schema.len() >= 2 && schema.starts_with('"') && schema.ends_with('"');
            !schema.is_empty() && (quoted || !schema.contains([' ', '"']))
        })
}

fn is_transaction_control(q: &str) -> bool {
    let head = q.split_whitespace().next().unwrap_or("").to_ascii_uppercase();
    matches!(head.as_str(), "BEGIN" | "COMMIT" | "ROLLBACK" | "SAVEPOINT" | "RELEASE" | "START" | "END")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The environment a real child got: `env` run through [`spawn`] (in the simulator's
    /// place: the part names only the log file), read from its log.
    async fn child_env(configured: bool) -> Vec<String> {
        let dir = std::env::temp_dir().join(format!("boxoffice-spawn-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let extra = [("BOXOFFICE_SET_BY_P3".to_owned(), "1".to_owned())];
        let mut p =
            spawn(Part::Simulator, Path::new("/usr/bin/env"), &[], &extra, &dir, None, configured).unwrap();
        assert!(p.child.wait().await.unwrap().success());
        let out = std::fs::read_to_string(&p.log).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        out.lines().filter_map(|l| l.split_once('=')).map(|(k, _)| k.to_owned()).collect()
    }

    #[tokio::test]
    async fn children_inherit_only_the_configuration_and_the_basics() {
        // Cargo and nextest set CARGO_* (and NEXTEST_*) for every test process.
        assert!(std::env::vars().any(|(k, _)| k.starts_with("CARGO_")), "the precondition of this test");
        for configured in [true, false] {
            let got = child_env(configured).await;
            assert!(got.iter().any(|k| k == "PATH"), "{got:?}");
            assert!(got.iter().any(|k| k == "BOXOFFICE_SET_BY_P3"), "what P3 sets is always passed: {got:?}");
            for k in &got {
                assert!(!k.starts_with("CARGO_") && !k.starts_with("NEXTEST_"), "{k} reached a child");
                assert!(inherited(k, configured) || k == "BOXOFFICE_SET_BY_P3", "{k} reached a child");
            }
        }
        assert!(!inherited("BOXOFFICE_CONFIG", true) && inherited("BOXOFFICE_DATABASE_URL", true));
        assert!(!inherited("BOXOFFICE_ADMIN_TOKEN", false), "the broker gets no boxoffice secret");
        assert!(inherited("OTEL_EXPORTER_OTLP_HEADERS", false) && inherited("SSL_CERT_FILE", false));
        assert!(!inherited("AWS_SECRET_ACCESS_KEY", true));
        assert!(
            inherited("RUST_LOG", true) && !inherited("RUST_LOG", false),
            "the broker logs as it defaults"
        );
    }

    #[test]
    fn reads_assigned_partitions_per_consumer() {
        let text = "# TYPE boxoffice_consumer_assigned_partitions gauge\n\
            boxoffice_consumer_assigned_partitions{consumer=\"saga\"} 12\n\
            boxoffice_consumer_assigned_partitions{consumer=\"payments\"} 3\n\
            boxoffice_consumer_lag{consumer=\"saga\",partition=\"1\"} 0\n";
        assert_eq!(assigned_partitions(text), vec![("saga".into(), 12.0), ("payments".into(), 3.0)]);
    }

    #[test]
    fn transaction_control_is_not_a_statement() {
        for q in ["BEGIN", "commit", " ROLLBACK", "SAVEPOINT sp1", "RELEASE SAVEPOINT sp1"] {
            assert!(is_transaction_control(q), "{q}");
        }
        assert!(!is_transaction_control("SELECT 1"));
        assert!(!is_transaction_control("INSERT INTO inbox VALUES ($1)"));
        assert!(is_commit_trigger("SELECT required, valid_until\n  FROM region_lease"));
        assert!(is_commit_trigger("SELECT required, valid_until FROM public.region_lease"));
        assert!(is_commit_trigger("SELECT required, valid_until FROM \"my schema\".region_lease"));
        assert!(is_commit_trigger("SELECT set_config($1, txid_current()::text, $2)"));
        assert!(!is_commit_trigger("SELECT required, valid_until FROM region_lease WHERE required"));
        assert!(!is_commit_trigger("SELECT required, valid_until FROM public.region_lease WHERE required"));
        assert!(!is_commit_trigger("SELECT required, valid_until FROM region_lease_archive"));
    }
}
