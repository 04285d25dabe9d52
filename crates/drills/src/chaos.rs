//! `boxoffice-drills chaos`: an onsale with every role as its own operating-system process,
//! under a seeded schedule of crashes and outages, followed by the audit.
//!
//! Owns the chaos run: a fresh database (`boxoffice_chaos_<seed>_<random>`), its own nisshi
//! broker on a free port with SQLite storage (a broker restart keeps topics and committed
//! offsets), a `boxoffice-drills stripe-sim` process (a child of this very binary), two
//! processes of each role (`boxoffice serve --roles X`, the product binary:
//! `--boxoffice-bin`, else the `boxoffice` file next to this executable), a round-robin TCP
//! load balancer in front of the two API processes (buyers and webhooks go through it, so an
//! API crash costs a retry, not the onsale), the simulated buyers of
//! [`boxoffice_harness::buyers`], and a supervisor that restarts whatever died. The schedule
//! ([`plan`], a pure function of the seed) kills role processes with SIGKILL, restarts the
//! broker, terminates the run database's PostgreSQL backends, opens Stripe fault windows
//! (latency, 500 after apply, dropped responses, duplicated, delayed and reordered webhooks)
//! and, with `--restart-postgres`, restarts PostgreSQL; it also arms one-shot abort-mode
//! fault points (`BOXOFFICE_FAULTS`, [`boxoffice_faults`]) in some processes so they die at a
//! purchase-path boundary on their own.
//!
//! After `--duration` the faults stop, every process is brought back, the saga drains and the
//! audit runs ([`boxoffice::audit::run`]: ledger, provider, dead letters). It protects every
//! invariant of the purchase path at once: the run passes only when each audit count is 0
//! after crashes at arbitrary points (exit 1 on any violation, 2 when a check could not run).

use anyhow::Context;
use boxoffice::config::Config;
use boxoffice::runtime::Role;
use boxoffice_harness::buyers;
use boxoffice_harness::deploy;
use boxoffice_harness::drain::Drain;
use boxoffice_store::venue;
use boxoffice_stripe_sim::Faults;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use secrecy::{ExposeSecret, SecretString};
use serde::Serialize;
use serde_json::json;
use sqlx::{ConnectOptions, Connection};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

/// Options of `boxoffice-drills chaos`.
#[derive(Debug, Clone, clap::Args)]
pub struct ChaosArgs {
    /// Seed of the fault schedule and of the buyers' choices: the same seed gives the same
    /// schedule (`--plan` prints it).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// How long faults are injected (`90s`, `2m`); buyers arrive over the same span.
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Simulated buyers (default: 2 per second of `--duration`).
    #[arg(long)]
    pub buyers: Option<usize>,
    /// Print the report as JSON on stdout (the event log goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// Also restart PostgreSQL itself (`pg_ctlcluster … restart`): disturbs every other
    /// database user of the server, so only on request.
    #[arg(long)]
    pub restart_postgres: bool,
    /// Print the seeded schedule and exit without running anything.
    #[arg(long)]
    pub plan: bool,
    /// Extra environment for every role process, `KEY=VALUE` (repeatable), applied last.
    #[arg(long = "role-env", value_parser = parse_key_value)]
    pub role_env: Vec<(String, String)>,
    /// Hold time to live in the role processes (abandoned holds must expire within the run).
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    pub hold_ttl: Duration,
    /// Bound on the wait for every order to be final, every cancel recorded and the
    /// outbox empty after the faults.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    pub drain_timeout: Duration,
    /// Keep the run database and the run directory (logs, broker storage) afterwards.
    #[arg(long)]
    pub keep: bool,
    /// The nisshi broker binary (default: `nisshi` on PATH, else ~/.cargo/bin/nisshi).
    #[arg(long, env = "BOXOFFICE_NISSHI_BIN")]
    pub nisshi: Option<PathBuf>,
    /// The product binary whose `serve --roles X` processes the run starts (default: the
    /// `boxoffice` file next to this executable, where cargo puts both).
    #[arg(long, env = "BOXOFFICE_BIN")]
    pub boxoffice_bin: Option<PathBuf>,
}

fn parse_key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_owned(), v.to_owned())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

/// Role processes of a run, two of each, in this order: `api#0, api#1, relay#0, …`.
pub const ROLES: [Role; 6] =
    [Role::Api, Role::Relay, Role::Saga, Role::Payments, Role::Tickets, Role::Expiry];
/// Processes per role.
pub const PER_ROLE: usize = 2;
/// Kafka partitions of the run's topics (few: this is about faults, not throughput).
const PARTITIONS: &str = "4";

/// The names of the role processes, `role#index`.
pub fn role_process_names() -> Vec<String> {
    ROLES.iter().flat_map(|r| (0..PER_ROLE).map(move |i| format!("{}#{i}", r.name()))).collect()
}

/// The fault points a role's process passes through (see [`boxoffice_faults::POINTS`]).
fn fault_points(role: Role) -> Vec<String> {
    let consumer = |name: &str| {
        boxoffice_faults::CONSUMER_BOUNDARIES.iter().map(|b| format!("{name}.{b}")).collect::<Vec<_>>()
    };
    match role {
        Role::Api => {
            ["hold.before_commit", "hold.after_commit", "webhook.before_commit", "webhook.after_commit"]
                .map(String::from)
                .to_vec()
        }
        Role::Relay => {
            ["relay.before_publish", "relay.after_publish", "relay.after_commit"].map(String::from).to_vec()
        }
        Role::Saga | Role::Payments | Role::Tickets => consumer(role.name()),
        Role::Expiry | Role::Router => Vec::new(),
    }
}

/// One-shot abort at a random point of `role` with a small probability per pass, or nothing:
/// `point=P%1*return(abort)`. One-shot, so a process dies there at most once per start.
fn draw_fault_spec(rng: &mut StdRng, role: Role, chance: f64) -> String {
    let points = fault_points(role);
    if points.is_empty() || !rng.gen_bool(chance) {
        return String::new();
    }
    let point = points.choose(rng).expect("not empty");
    let pct = [1, 2, 3, 5].choose(rng).expect("not empty");
    format!("{point}={pct}%1*return(abort)")
}

/// One injection of the schedule.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Action {
    /// SIGKILL a role process; the supervisor restarts it `down_ms` later with
    /// `faults_on_restart` as its `BOXOFFICE_FAULTS`.
    Kill {
        /// `role#index`.
        process: String,
        /// How long it stays down, ms.
        down_ms: u64,
        /// Fault points armed in the restarted process (empty: none).
        faults_on_restart: String,
    },
    /// SIGKILL the broker and start it again on the same port and storage `down_ms` later.
    RestartBroker {
        /// How long it stays down, ms.
        down_ms: u64,
    },
    /// `pg_terminate_backend` every connection to the run database.
    TerminateBackends,
    /// Restart the PostgreSQL server (only with `--restart-postgres`).
    RestartPostgres,
    /// Set the Stripe simulator's faults (until the next `ClearStripeFaults`).
    StripeFaults {
        /// The faults.
        faults: Faults,
    },
    /// Clear the Stripe simulator's faults.
    ClearStripeFaults,
}

impl Action {
    /// The counter this action adds to in the report.
    fn kind(&self) -> &'static str {
        match self {
            Action::Kill { .. } => "kill",
            Action::RestartBroker { .. } => "broker_restart",
            Action::TerminateBackends => "terminate_backends",
            Action::RestartPostgres => "postgres_restart",
            Action::StripeFaults { .. } => "stripe_fault_window",
            Action::ClearStripeFaults => "stripe_faults_cleared",
        }
    }

    fn describe(&self) -> String {
        match self {
            Action::Kill { process, down_ms, faults_on_restart } => {
                let f = if faults_on_restart.is_empty() {
                    String::new()
                } else {
                    format!(", then arm {faults_on_restart}")
                };
                format!("kill -9 {process} (down {:.1}s{f})", *down_ms as f64 / 1e3)
            }
            Action::RestartBroker { down_ms } => {
                format!("kill -9 broker (down {:.1}s, same port and storage)", *down_ms as f64 / 1e3)
            }
            Action::TerminateBackends => "pg_terminate_backend on the run database".into(),
            Action::RestartPostgres => "restart PostgreSQL".into(),
            Action::StripeFaults { faults } => format!("stripe faults {}", describe_faults(faults)),
            Action::ClearStripeFaults => "stripe faults cleared".into(),
        }
    }
}

fn describe_faults(f: &Faults) -> String {
    let mut parts = Vec::new();
    if f.latency_ms > 0 {
        parts.push(format!("latency {}ms", f.latency_ms));
    }
    if f.fail_after_apply_rate > 0.0 {
        parts.push(format!("500-after-apply {:.0}%", f.fail_after_apply_rate * 100.0));
    }
    if f.drop_response_rate > 0.0 {
        parts.push(format!("drop-response {:.0}%", f.drop_response_rate * 100.0));
    }
    if f.webhook_duplicates > 0 {
        parts.push(format!("webhooks ×{}", f.webhook_duplicates + 1));
    }
    if f.webhook_reorder {
        parts.push("webhooks reordered".into());
    }
    if f.webhook_delay_ms > 0 {
        parts.push(format!("webhook delay {}ms", f.webhook_delay_ms));
    }
    parts.join(", ")
}

/// An action at an offset from the start of the run.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Step {
    /// Offset from the start of the buyers, ms.
    pub at_ms: u64,
    /// What happens.
    #[serde(flatten)]
    pub action: Action,
}

/// The whole schedule of a run.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Plan {
    /// The seed it was drawn from.
    pub seed: u64,
    /// Span of the faults, ms.
    pub duration_ms: u64,
    /// `BOXOFFICE_FAULTS` of each role process at its first start (absent: none).
    pub initial_faults: BTreeMap<String, String>,
    /// Injections in time order.
    pub steps: Vec<Step>,
}

impl Plan {
    /// The schedule as text, one line per step.
    pub fn render(&self) -> String {
        let mut out = format!(
            "chaos plan: seed {}, {:.0}s of faults, {} steps\n",
            self.seed,
            self.duration_ms as f64 / 1e3,
            self.steps.len()
        );
        for (p, f) in &self.initial_faults {
            out.push_str(&format!("  t=0.0s arm {f} in {p}\n"));
        }
        for s in &self.steps {
            out.push_str(&format!("  t={:.1}s {}\n", s.at_ms as f64 / 1e3, s.action.describe()));
        }
        out
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Kill,
    Broker,
    Terminate,
    Stripe,
    Postgres,
}

/// Draws the schedule of a run from `seed`: the first steps cover every kind of injection
/// once (a kill, a broker restart, a backend termination, a Stripe fault window with
/// duplicated webhooks, a PostgreSQL restart when `restart_postgres`), then kinds are drawn by
/// weight every 0.8–3 s until 1 s before `duration`. Stripe windows never overlap; broker and
/// PostgreSQL restarts are spaced so one outage ends before the next of its kind begins.
pub fn plan(seed: u64, duration: Duration, restart_postgres: bool) -> Plan {
    let mut rng = StdRng::seed_from_u64(seed);
    let duration_ms = duration.as_millis() as u64;
    let mut initial_faults = BTreeMap::new();
    for (i, name) in role_process_names().into_iter().enumerate() {
        let spec = draw_fault_spec(&mut rng, ROLES[i / PER_ROLE], 0.4);
        if !spec.is_empty() {
            initial_faults.insert(name, spec);
        }
    }
    let end = duration_ms.saturating_sub(1_000);
    let mut t = 2_000.min(end / 4);
    let mut mandatory = vec![Kind::Kill, Kind::Broker, Kind::Terminate, Kind::Stripe];
    if restart_postgres {
        mandatory.push(Kind::Postgres);
    }
    mandatory.shuffle(&mut rng);
    let (mut stripe_free, mut broker_free, mut pg_free) = (0u64, 0u64, 0u64);
    let mut first_stripe = true;
    let names = role_process_names();
    let mut steps = Vec::new();
    while t < end {
        let drawn = if mandatory.is_empty() {
            let weights: &[(Kind, u32)] = &[
                (Kind::Kill, 45),
                (Kind::Broker, 10),
                (Kind::Terminate, 15),
                (Kind::Stripe, 20),
                (Kind::Postgres, if restart_postgres { 8 } else { 0 }),
            ];
            weights.choose_weighted(&mut rng, |w| w.1).map(|w| w.0).unwrap_or(Kind::Kill)
        } else {
            mandatory.remove(0)
        };
        let kind = match drawn {
            Kind::Stripe if t < stripe_free => Kind::Kill,
            Kind::Broker if t < broker_free => Kind::Kill,
            Kind::Postgres if t < pg_free => Kind::Terminate,
            k => k,
        };
        match kind {
            Kind::Kill => {
                let i = rng.gen_range(0..names.len());
                let down_ms = rng.gen_range(300..=3_000);
                let faults_on_restart = draw_fault_spec(&mut rng, ROLES[i / PER_ROLE], 0.3);
                steps.push(Step {
                    at_ms: t,
                    action: Action::Kill { process: names[i].clone(), down_ms, faults_on_restart },
                });
            }
            Kind::Broker => {
                let down_ms = rng.gen_range(500..=2_500);
                broker_free = t + down_ms + 3_000;
                steps.push(Step { at_ms: t, action: Action::RestartBroker { down_ms } });
            }
            Kind::Terminate => steps.push(Step { at_ms: t, action: Action::TerminateBackends }),
            Kind::Postgres => {
                pg_free = t + 10_000;
                steps.push(Step { at_ms: t, action: Action::RestartPostgres });
            }
            Kind::Stripe => {
                let window = rng.gen_range(2_000..=6_000).min(end.saturating_sub(t).max(500));
                let faults = draw_stripe_faults(&mut rng, first_stripe);
                first_stripe = false;
                stripe_free = t + window + 500;
                steps.push(Step { at_ms: t, action: Action::StripeFaults { faults } });
                steps.push(Step { at_ms: t + window, action: Action::ClearStripeFaults });
            }
        }
        t += rng.gen_range(800..=3_000);
    }
    steps.sort_by_key(|s| s.at_ms);
    Plan { seed, duration_ms, initial_faults, steps }
}

/// One to three Stripe faults (always duplicated webhooks when `duplicates`).
fn draw_stripe_faults(rng: &mut StdRng, duplicates: bool) -> Faults {
    let mut f = Faults { seed: rng.gen(), ..Faults::default() };
    if duplicates {
        f.webhook_duplicates = rng.gen_range(1..=3);
    }
    let n = rng.gen_range(1..=3);
    for k in (0..6).collect::<Vec<u8>>().choose_multiple(rng, n) {
        match k {
            0 => f.latency_ms = rng.gen_range(50..=600),
            1 => f.fail_after_apply_rate = rng.gen_range(0.05..0.2),
            2 => f.drop_response_rate = rng.gen_range(0.01..0.05),
            3 => f.webhook_duplicates = rng.gen_range(1..=3),
            4 => f.webhook_reorder = true,
            _ => f.webhook_delay_ms = rng.gen_range(100..=1_500),
        }
    }
    f
}

/// What a supervised process is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ProcKind {
    Role(Role),
    Broker,
    StripeSim,
}

/// One supervised child process and how to (re)start it.
struct Proc {
    name: String,
    kind: ProcKind,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    cwd: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    /// `BOXOFFICE_FAULTS` for the next start (role processes only).
    faults: String,
    /// Down on purpose until then (`None` with no child: restart at once).
    restart_at: Option<Instant>,
    starts: u32,
}

/// The children of a run, restarting what dies, and the log of everything done to them.
struct Supervisor {
    procs: tokio::sync::Mutex<Vec<Proc>>,
    started: Instant,
    /// Lines of the event log (`t=12.3s kill -9 saga#1 (pid 4242)`).
    events: Mutex<Vec<String>>,
    counts: Mutex<BTreeMap<&'static str, u64>>,
    /// Event lines go to stderr (JSON mode) instead of stdout.
    to_stderr: bool,
    /// The faults are over: restart everything at once and without fault points.
    calm: AtomicBool,
    /// The run is over: restart nothing.
    stopping: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Supervisor {
    fn note(&self, line: impl AsRef<str>) {
        let line = format!("t={:.1}s {}", self.started.elapsed().as_secs_f64(), line.as_ref());
        if self.to_stderr {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
        lock(&self.events).push(line);
    }

    fn count(&self, kind: &'static str, n: u64) {
        *lock(&self.counts).entry(kind).or_default() += n;
    }

    /// Starts `p` (appending its output to its log file).
    fn spawn(&self, p: &mut Proc) -> anyhow::Result<u32> {
        use std::io::Write;
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&p.log)
            .with_context(|| format!("opening {}", p.log.display()))?;
        let faults = if matches!(p.kind, ProcKind::Role(_)) { p.faults.clone() } else { String::new() };
        writeln!(
            log,
            "=== start {} of {} at t={:.1}s{}",
            p.starts + 1,
            p.name,
            self.started.elapsed().as_secs_f64(),
            if faults.is_empty() { String::new() } else { format!(" with BOXOFFICE_FAULTS={faults}") }
        )?;
        let mut cmd = Command::new(&p.program);
        cmd.args(&p.args)
            .envs(p.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&p.cwd)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true);
        if matches!(p.kind, ProcKind::Role(_)) {
            cmd.env("BOXOFFICE_FAULTS", &faults);
        }
        only_stdio(cmd.as_std_mut(), true);
        let child = cmd.spawn().with_context(|| format!("starting {} ({})", p.name, p.program.display()))?;
        let pid = child.id().unwrap_or_default();
        p.child = Some(child);
        p.restart_at = None;
        p.starts += 1;
        Ok(pid)
    }

    /// Reaps exited children (counting fault aborts) and restarts whatever is due.
    async fn tick(&self) {
        let mut procs = self.procs.lock().await;
        let now = Instant::now();
        let calm = self.calm.load(Ordering::SeqCst);
        for p in procs.iter_mut() {
            if let Some(c) = &mut p.child {
                if let Ok(Some(status)) = c.try_wait() {
                    p.child = None;
                    let aborted =
                        std::os::unix::process::ExitStatusExt::signal(&status) == Some(libc::SIGABRT);
                    if aborted {
                        self.count("fault_abort", 1);
                        self.note(format!("{} aborted at an armed fault point ({status})", p.name));
                    } else {
                        self.count("unexpected_exit", 1);
                        self.note(format!("{} exited on its own ({status})", p.name));
                    }
                    // Whatever fired is used up: the restart runs without fault points.
                    p.faults.clear();
                    p.restart_at = Some(now + Duration::from_millis(300));
                }
            }
            if p.child.is_some() || self.stopping.load(Ordering::SeqCst) {
                continue;
            }
            if calm || p.restart_at.is_none_or(|at| at <= now) {
                if calm {
                    p.faults.clear();
                }
                match self.spawn(p) {
                    Ok(pid) => {
                        self.count("restart", 1);
                        let f =
                            if p.faults.is_empty() { String::new() } else { format!(", armed {}", p.faults) };
                        self.note(format!("restart {} (pid {pid}{f})", p.name));
                    }
                    Err(e) => {
                        self.note(format!("restart {} failed: {e:#}", p.name));
                        p.restart_at = Some(now + Duration::from_secs(1));
                    }
                }
            }
        }
    }

    /// SIGKILLs `name` and schedules its restart; `false` when it was not running.
    async fn kill(&self, name: &str, down: Duration, faults: &str) -> bool {
        let mut procs = self.procs.lock().await;
        let Some(p) = procs.iter_mut().find(|p| p.name == name) else {
            return false;
        };
        let Some(mut child) = p.child.take() else {
            self.note(format!("kill -9 {name}: skipped, already down"));
            return false;
        };
        let pid = child.id().unwrap_or_default();
        let _ = child.start_kill();
        let _ = child.wait().await;
        p.faults = faults.to_owned();
        p.restart_at = Some(Instant::now() + down);
        self.note(format!("kill -9 {name} (pid {pid})"));
        true
    }

    /// Kills every child and restarts nothing any more.
    async fn stop_all(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        let mut procs = self.procs.lock().await;
        for p in procs.iter_mut() {
            if let Some(mut c) = p.child.take() {
                let _ = c.start_kill();
                let _ = c.wait().await;
            }
        }
    }

    /// The log files of every process.
    async fn logs(&self) -> Vec<(String, PathBuf)> {
        self.procs.lock().await.iter().map(|p| (p.name.clone(), p.log.clone())).collect()
    }
}

/// Children inherit stdin/stdout/stderr and nothing else: every other descriptor is marked
/// close-on-exec (a PostgreSQL restart started from a process that holds a lock file must
/// not hand that lock to the server for its lifetime). With `die_with_parent`, the child is
/// also SIGKILLed when this process dies, so a crashed run leaves no orphans, and writes no
/// core file when it aborts at a fault point.
pub(crate) fn only_stdio(cmd: &mut std::process::Command, die_with_parent: bool) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs between fork and exec and only makes async-signal-safe system
    // calls (close_range, fcntl, prctl, setrlimit); it allocates nothing and takes no lock.
    unsafe {
        cmd.pre_exec(move || {
            const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
            if libc::syscall(libc::SYS_close_range, 3 as libc::c_uint, libc::c_uint::MAX, CLOSE_RANGE_CLOEXEC)
                != 0
            {
                for fd in 3..4_096 {
                    let flags = libc::fcntl(fd, libc::F_GETFD);
                    if flags >= 0 {
                        libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
                    }
                }
            }
            if die_with_parent {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                let no_core = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
                libc::setrlimit(libc::RLIMIT_CORE, &no_core);
            }
            Ok(())
        });
    }
}

/// A free loopback port (bound once and released: another process could take it in between,
/// which on loopback in a test run is rare enough).
pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The nisshi binary: `--nisshi`/`BOXOFFICE_NISSHI_BIN`, else `nisshi` on PATH, else
/// `~/.cargo/bin/nisshi`.
pub(crate) fn find_nisshi(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = given {
        anyhow::ensure!(p.is_file(), "nisshi binary {} not found", p.display());
        return Ok(p.to_owned());
    }
    let on_path = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).map(|d| d.join("nisshi")).collect::<Vec<_>>())
        .unwrap_or_default();
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    on_path
        .into_iter()
        .chain(cargo_home.map(|c| c.join("bin").join("nisshi")))
        .find(|p| p.is_file())
        .context("the nisshi broker is needed: install it (`cargo install nisshi --locked`, scripts/test does) or pass --nisshi")
}

/// The programs a run starts.
struct Programs {
    /// The broker.
    nisshi: PathBuf,
    /// This binary, for the `stripe-sim` process.
    drills: PathBuf,
    /// The product binary, for the role processes.
    boxoffice: PathBuf,
}

/// The product binary: `--boxoffice-bin`/`BOXOFFICE_BIN`, else `boxoffice` next to `exe`.
pub(crate) fn find_boxoffice(given: Option<&Path>, exe: &Path) -> anyhow::Result<PathBuf> {
    let path = match given {
        Some(p) => p.to_owned(),
        None => exe.with_file_name("boxoffice"),
    };
    anyhow::ensure!(
        path.is_file(),
        "the product binary {} was not found: build it (`cargo build{} -p boxoffice`) or pass --boxoffice-bin",
        path.display(),
        if exe.components().any(|c| c.as_os_str() == "release") { " --release" } else { "" }
    );
    Ok(path)
}

/// Round-robin TCP load balancer: each accepted connection goes to the next backend that
/// accepts a connection within 500 ms, skipping dead ones; the bytes are copied both ways.
async fn load_balancer(
    listener: tokio::net::TcpListener,
    backends: Vec<SocketAddr>,
    shutdown: CancellationToken,
) {
    let next = Arc::new(AtomicUsize::new(0));
    loop {
        let (mut client, _) = tokio::select! {
            _ = shutdown.cancelled() => return,
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(_) => continue,
            },
        };
        let (backends, next) = (backends.clone(), next.clone());
        tokio::spawn(async move {
            for _ in 0..backends.len() {
                let b = backends[next.fetch_add(1, Ordering::Relaxed) % backends.len()];
                let connect =
                    tokio::time::timeout(Duration::from_millis(500), tokio::net::TcpStream::connect(b));
                if let Ok(Ok(mut upstream)) = connect.await {
                    let _ = upstream.set_nodelay(true);
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                    return;
                }
            }
        });
    }
}

/// Waits until `ok` holds, polling every 100 ms; `false` at the deadline.
pub(crate) async fn wait_until<F, Fut>(timeout: Duration, mut ok: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if ok().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub(crate) async fn port_open(addr: SocketAddr) -> bool {
    tokio::net::TcpStream::connect(addr).await.is_ok()
}

/// Runs `boxoffice-drills chaos`; returns the exit code (0: every audit count is 0; 1: a violation;
/// 2: a check could not run, or the run itself failed or was interrupted: the error is
/// printed). Errors only on invalid options.
pub async fn run(cfg: Config, args: ChaosArgs) -> anyhow::Result<i32> {
    anyhow::ensure!(args.duration >= Duration::from_secs(5), "--duration must be at least 5s");
    anyhow::ensure!(args.hold_ttl >= Duration::from_secs(1), "--hold-ttl must be at least 1s");
    let plan = plan(args.seed, args.duration, args.restart_postgres);
    if args.plan {
        if args.json {
            println!("{}", serde_json::to_string_pretty(&plan)?);
        } else {
            print!("{}", plan.render());
        }
        return Ok(0);
    }
    let drills = std::env::current_exe().context("locating the boxoffice-drills binary")?;
    let programs = Programs {
        nisshi: find_nisshi(args.nisshi.as_deref())?,
        boxoffice: find_boxoffice(args.boxoffice_bin.as_deref(), &drills)?,
        drills,
    };
    let tag = format!("{}_{}", args.seed, &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let run_dir = std::env::temp_dir().join(format!("boxoffice-chaos-{tag}"));
    std::fs::create_dir_all(&run_dir).with_context(|| format!("creating {}", run_dir.display()))?;
    let db_name = format!("boxoffice_chaos_{tag}");
    let sup = Arc::new(Supervisor {
        procs: tokio::sync::Mutex::new(Vec::new()),
        started: Instant::now(),
        events: Mutex::new(Vec::new()),
        counts: Mutex::new(BTreeMap::new()),
        to_stderr: args.json,
        calm: AtomicBool::new(false),
        stopping: AtomicBool::new(false),
    });
    let lb_shutdown = CancellationToken::new();
    let run = Run {
        base: &cfg,
        args: &args,
        plan: &plan,
        sup: &sup,
        run_dir: &run_dir,
        db_name: &db_name,
        programs: &programs,
    };
    let outcome = tokio::select! {
        r = chaos(&run, lb_shutdown.clone()) => r,
        _ = boxoffice::commands::wait_for_signal() => Err(anyhow::anyhow!("interrupted")),
    };
    lb_shutdown.cancel();
    sup.stop_all().await;
    let keep = args.keep || !matches!(outcome, Ok(0));
    if !args.keep {
        if let Err(e) = drop_database(&cfg, &db_name).await {
            eprintln!("warning: dropping database {db_name}: {e:#}");
        }
    }
    if keep {
        if !matches!(outcome, Ok(0)) {
            for (name, log) in sup.logs().await {
                eprintln!("--- last lines of {name} ({}) ---", log.display());
                eprintln!("{}", tail(&log, 25));
            }
        }
        eprintln!("run directory (logs, broker storage): {}", run_dir.display());
    } else {
        let _ = std::fs::remove_dir_all(&run_dir);
    }
    outcome.or_else(|e| {
        eprintln!("error: the chaos run could not complete: {e:#}");
        Ok(2)
    })
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A connection to the server's maintenance database `postgres` (the configured database
/// may not exist: the run only needs the server).
async fn admin_connection(cfg: &Config) -> anyhow::Result<sqlx::PgConnection> {
    let opts = cfg.pg_options()?.database("postgres");
    sqlx::PgConnection::connect_with(&opts).await.context("connecting to the postgres database")
}

async fn drop_database(cfg: &Config, name: &str) -> anyhow::Result<()> {
    let mut conn = admin_connection(cfg).await?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)")).execute(&mut conn).await?;
    Ok(())
}

/// What a chaos run works with, fixed before it starts.
struct Run<'a> {
    base: &'a Config,
    args: &'a ChaosArgs,
    plan: &'a Plan,
    sup: &'a Arc<Supervisor>,
    run_dir: &'a Path,
    db_name: &'a str,
    programs: &'a Programs,
}

/// After [`prepare`]: the run's own database (seeded), configuration and addresses.
struct Prepared {
    run_started: chrono::DateTime<chrono::Utc>,
    cfg: Config,
    db_url: String,
    pool: sqlx::PgPool,
    event: boxoffice_domain::EventId,
    buyers: usize,
    broker_addr: SocketAddr,
    sim_addr: SocketAddr,
    sim_base: String,
}

/// After [`deploy`]: every process started and answering, behind the load balancer.
struct Deployed {
    api_url: String,
    http: reqwest::Client,
    _ticker: AbortOnDrop,
}

/// After [`drain_and_audit`].
struct Audited {
    drained: bool,
    report: boxoffice::audit::AuditReport,
}

/// The run proper, phase by phase: set-up, processes, buyers under the schedule, drain and
/// audit, report. Returns the exit code.
async fn chaos(run: &Run<'_>, lb_shutdown: CancellationToken) -> anyhow::Result<i32> {
    let prepared = prepare(run).await?;
    let deployed = deploy(run, &prepared, lb_shutdown).await?;
    let stats = drive_buyers(run, &prepared, &deployed).await?;
    let audited = drain_and_audit(run, &prepared).await?;
    report(run, &prepared, &stats, &audited)
}

/// Phase 1: the run's configuration (its database, a free broker and simulator port), the
/// database migrated and seeded with a venue sized for the buyers.
async fn prepare(run: &Run<'_>) -> anyhow::Result<Prepared> {
    let (base, args, db_name, sup) = (run.base, run.args, run.db_name, run.sup);
    let run_started = chrono::Utc::now();
    let db_opts = base.pg_options()?.database(db_name);
    let db_url = db_opts.to_url_lossy().to_string();
    let mut cfg = base.clone();
    cfg.database_url = SecretString::from(db_url.clone());
    let broker_addr: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    cfg.kafka_brokers = Some(broker_addr.to_string());
    cfg.kafka_partitions = PARTITIONS.parse()?;
    let sim_addr: SocketAddr = format!("127.0.0.1:{}", free_port()?).parse()?;
    let sim_base = format!("http://{sim_addr}");
    cfg.stripe_api_base = sim_base.clone();
    // This process only seeds, drains and audits; the role processes hold the rest (at most
    // 28 connections in all, so two runs side by side fit a default PostgreSQL).
    cfg.db_max_connections = 3;
    cfg.db_acquire_timeout_ms = 30_000;

    let pool = boxoffice::commands::migrate_db(&cfg).await?;
    let buyers_n = args.buyers.unwrap_or((args.duration.as_secs() as usize * 2).max(10));
    let rows = (buyers_n as u32 * 5 / 2).div_ceil(40).max(2);
    let spec = venue::VenueSpec::small(2, rows, 20);
    let (event, seats) = venue::seed(
        &pool,
        &format!("Chaos onsale {tag}", tag = db_name.trim_start_matches("boxoffice_chaos_")),
        &spec,
        chrono::Utc::now() + chrono::Duration::days(30),
        &cfg.purchase_cell,
    )
    .await?;
    sup.note(format!(
        "database {db_name}, event {} with {seats} seats, {buyers_n} buyers over {:.0}s, run directory {}",
        event.0,
        args.duration.as_secs_f64(),
        run.run_dir.display()
    ));
    Ok(Prepared { run_started, cfg, db_url, pool, event, buyers: buyers_n, broker_addr, sim_addr, sim_base })
}

/// Phase 2: the broker (persistent storage in the run directory) and its topics, the load
/// balancer in front of the API processes, the simulator delivering webhooks through it,
/// two processes of each role, the supervisor loop; returns once all of them answer.
async fn deploy(run: &Run<'_>, p: &Prepared, lb_shutdown: CancellationToken) -> anyhow::Result<Deployed> {
    let (sup, run_dir, programs) = (run.sup, run.run_dir, run.programs);
    let (cfg, broker_addr, sim_addr) = (&p.cfg, p.broker_addr, p.sim_addr);
    let mut procs = vec![broker_proc(run, broker_addr)];
    let pid = sup.spawn(&mut procs[0])?;
    sup.note(format!("start broker (pid {pid}, storage {}/nisshi.db)", run_dir.display()));
    anyhow::ensure!(
        wait_until(Duration::from_secs(30), || port_open(broker_addr)).await,
        "the broker did not open {broker_addr} (see {})",
        run_dir.join("broker.log").display()
    );
    let mut created = Err(anyhow::anyhow!("not tried"));
    for _ in 0..20 {
        created = deploy::create_topics(cfg, None).await;
        if created.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    created.context("creating topics")?;

    // The API addresses and the load balancer in front of them.
    let api_addrs = (0..PER_ROLE)
        .map(|_| -> anyhow::Result<SocketAddr> { Ok(format!("127.0.0.1:{}", free_port()?).parse()?) })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let lb = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let lb_addr = lb.local_addr()?;
    tokio::spawn(load_balancer(lb, api_addrs.clone(), lb_shutdown));
    let api_url = format!("http://{lb_addr}");

    let secrets = secret_env(cfg);
    procs.push(Proc {
        name: "stripe-sim".into(),
        kind: ProcKind::StripeSim,
        program: programs.drills.clone(),
        args: vec![
            "stripe-sim".into(),
            "--bind".into(),
            sim_addr.to_string(),
            "--webhook-url".into(),
            format!("{api_url}/webhooks/stripe"),
        ],
        env: secrets.clone(),
        cwd: run_dir.to_owned(),
        log: run_dir.join("stripe-sim.log"),
        child: None,
        faults: String::new(),
        restart_at: None,
        starts: 0,
    });
    procs.extend(role_procs(run, p, &api_addrs, &secrets));
    for proc in procs.iter_mut().skip(1) {
        let pid = sup.spawn(proc)?;
        let f = if proc.faults.is_empty() { String::new() } else { format!(", armed {}", proc.faults) };
        sup.note(format!("start {} (pid {pid}{f})", proc.name));
    }
    *sup.procs.lock().await = procs;

    let ticker = {
        let sup = sup.clone();
        tokio::spawn(async move {
            loop {
                sup.tick().await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let ticker = AbortOnDrop(ticker);

    // Ready: the simulator and both APIs answer (database and broker reachable).
    let http = reqwest::Client::builder().timeout(Duration::from_secs(5)).build()?;
    let ready = wait_until(Duration::from_secs(60), || {
        let http = http.clone();
        let (addrs, sim) = (api_addrs.clone(), p.sim_base.clone());
        async move {
            let sim_ok =
                http.get(format!("{sim}/_sim/stats")).send().await.is_ok_and(|r| r.status().is_success());
            let mut apis_ok = true;
            for a in addrs {
                apis_ok &= http
                    .get(format!("http://{a}/readyz"))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
            }
            sim_ok && apis_ok
        }
    })
    .await;
    anyhow::ensure!(ready, "the Stripe simulator or the API processes did not become ready within 60 s");
    sup.note(format!("ready: api behind {lb_addr}, broker {broker_addr}, stripe simulator {sim_addr}"));
    Ok(Deployed { api_url, http, _ticker: ticker })
}

/// The broker process, with SQLite storage in the run directory so a restart keeps topics and
/// committed offsets.
fn broker_proc(run: &Run<'_>, broker_addr: SocketAddr) -> Proc {
    let broker_url = format!("tcp://{broker_addr}");
    Proc {
        name: "broker".into(),
        kind: ProcKind::Broker,
        program: run.programs.nisshi.clone(),
        args: [
            "broker",
            "--listener-url",
            &broker_url,
            "--advertised-listener-url",
            &broker_url,
            "--storage-engine",
            "sqlite://nisshi.db",
            "--group-initial-rebalance-delay",
            "500ms",
        ]
        .map(String::from)
        .to_vec(),
        env: Vec::new(),
        cwd: run.run_dir.to_owned(),
        log: run.run_dir.join("broker.log"),
        child: None,
        faults: String::new(),
        restart_at: None,
        starts: 0,
    }
}

/// The secrets every child process shares with this one, as `BOXOFFICE_*` variables.
pub(crate) fn secret_env(cfg: &Config) -> Vec<(String, String)> {
    [
        ("BOXOFFICE_USER_JWT_SECRET", cfg.user_jwt_secret.expose_secret().to_owned()),
        ("BOXOFFICE_STRIPE_SECRET_KEY", cfg.stripe_secret_key.expose_secret().to_owned()),
        ("BOXOFFICE_STRIPE_WEBHOOK_SECRET", cfg.stripe_webhook_secret.expose_secret().to_owned()),
        ("BOXOFFICE_ADMISSION_KID", cfg.admission_kid.clone()),
        ("BOXOFFICE_ADMISSION_PRIVATE_KEY", cfg.admission_private_key.expose_secret().to_owned()),
    ]
    .map(|(k, v)| (k.to_owned(), v))
    .to_vec()
}

/// Two `serve --roles X` processes per role, with the plan's initial fault points armed.
fn role_procs(
    run: &Run<'_>,
    p: &Prepared,
    api_addrs: &[SocketAddr],
    secrets: &[(String, String)],
) -> Vec<Proc> {
    let (cfg, args, db_name) = (&p.cfg, run.args, run.db_name);
    let mut common: Vec<(String, String)> = [
        // The drill's own environment (development unless configured otherwise): the role
        // processes run with its secrets.
        ("BOXOFFICE_ENV", cfg.env.as_str().to_owned()),
        ("BOXOFFICE_DATABASE_URL", p.db_url.clone()),
        ("BOXOFFICE_KAFKA_BROKERS", p.broker_addr.to_string()),
        ("BOXOFFICE_KAFKA_TOPIC_PREFIX", cfg.kafka_topic_prefix.clone()),
        ("BOXOFFICE_KAFKA_PARTITIONS", PARTITIONS.to_owned()),
        ("BOXOFFICE_STRIPE_API_BASE", p.sim_base.clone()),
        ("BOXOFFICE_STRIPE_TIMEOUT_MS", "3000".to_owned()),
        ("BOXOFFICE_HOLD_TTL_MS", args.hold_ttl.as_millis().to_string()),
        // Buyers take POST /events/{id}/admission: the waiting room is not under test here.
        ("BOXOFFICE_ADMISSION_DIRECT", "true".to_owned()),
        ("BOXOFFICE_RELEASE_MAX_PER_S", "0".to_owned()),
        // The balancer is a TCP proxy: the buyers' own X-Forwarded-For stands for what an
        // HTTP balancer would append, so the per-IP buckets see buyers, not the balancer.
        ("BOXOFFICE_HTTP_TRUSTED_PROXY_HOPS", "1".to_owned()),
        ("BOXOFFICE_REDIS_KEY_PREFIX", format!("{}chaos:{tag}:", cfg.redis_key_prefix, tag = db_name)),
        // Small pools: twelve processes share one PostgreSQL server (24 connections at most,
        // plus each API process's release controller and each relay's own session).
        ("BOXOFFICE_DB_POOL_API", "3".to_owned()),
        ("BOXOFFICE_DB_POOL_WEBHOOKS", "1".to_owned()),
        ("BOXOFFICE_DB_POOL_RELAY", "1".to_owned()),
        ("BOXOFFICE_DB_POOL_SAGA", "2".to_owned()),
        ("BOXOFFICE_DB_POOL_PAYMENTS", "2".to_owned()),
        ("BOXOFFICE_DB_POOL_TICKETS", "2".to_owned()),
        ("BOXOFFICE_DB_POOL_EXPIRY", "1".to_owned()),
        ("BOXOFFICE_CONSUMER_LANES", "2".to_owned()),
        // Messages that exhaust the inline attempts during an outage come back within the run.
        ("BOXOFFICE_CONSUMER_RETRY_1M_DELAY_MS", "15000".to_owned()),
        // A leading relay whose PostgreSQL session goes silent (cut off, not killed) keeps the
        // outbox's lock for its lease: the shortest valid one (just above the producer's 30 s
        // delivery timeout) keeps the drain short.
        ("BOXOFFICE_RELAY_LEASE_MS", "31000".to_owned()),
    ]
    .map(|(k, v)| (k.to_owned(), v))
    .to_vec();
    common.extend(secrets.iter().cloned());
    common.extend(args.role_env.iter().cloned());
    let mut procs = Vec::new();
    for (i, name) in role_process_names().into_iter().enumerate() {
        let role = ROLES[i / PER_ROLE];
        let mut env = common.clone();
        if role == Role::Api {
            env.insert(0, ("BOXOFFICE_HTTP_BIND".into(), api_addrs[i % PER_ROLE].to_string()));
        }
        procs.push(Proc {
            faults: run.plan.initial_faults.get(&name).cloned().unwrap_or_default(),
            log: run.run_dir.join(format!("{}.log", name.replace('#', "-"))),
            name,
            kind: ProcKind::Role(role),
            program: run.programs.boxoffice.clone(),
            args: vec!["serve".into(), "--roles".into(), role.name().into()],
            env,
            cwd: run.run_dir.to_owned(),
            child: None,
            restart_at: None,
            starts: 0,
        });
    }
    procs
}

/// Phase 3: the simulated buyers and the fault schedule, side by side.
async fn drive_buyers(run: &Run<'_>, p: &Prepared, d: &Deployed) -> anyhow::Result<buyers::BuyerStats> {
    let (args, sup) = (run.args, run.sup);
    let users = boxoffice::runtime::user_tokens(&p.cfg);
    let mut bc = buyers::BuyerConfig::new(
        d.api_url.clone(),
        p.sim_base.clone(),
        p.cfg.stripe_publishable_key.clone(),
        p.event.0,
        Arc::new(move |u| users.issue(boxoffice_domain::UserId(u), 3_600)),
    );
    bc.buyers = p.buyers;
    bc.max_in_flight = 16;
    bc.poll_interval_ms = 500;
    bc.final_timeout_ms = args.hold_ttl.as_millis() as u64 + 60_000;
    bc.seed = args.seed;
    bc.arrival_rate = p.buyers as f64 / args.duration.as_secs_f64();
    let chaos_started = Instant::now();
    let (stats, ()) = tokio::join!(
        buyers::drive(bc),
        execute(run.plan, sup, run.base, run.db_name, &d.http, &p.sim_base, chaos_started)
    );
    let stats = stats?;
    sup.note(format!(
        "buyers done: {} holds, {} ticketed, {} expired, {} timed out, {} http errors (retried)",
        stats.holds, stats.ticketed_orders, stats.expired, stats.timed_out, stats.http_errors
    ));
    Ok(stats)
}

/// Phase 4: every order final, every cancel recorded and the outbox empty (riding out a database that still refuses
/// connections), then every invariant checked against the ledger, the simulator and the
/// dead-letter topic.
async fn drain_and_audit(run: &Run<'_>, p: &Prepared) -> anyhow::Result<Audited> {
    let (args, sup, pool, cfg) = (run.args, run.sup, &p.pool, &p.cfg);
    let drained = Drain::orders_of(p.event.0, args.drain_timeout)
        .every(Duration::from_millis(250))
        .retrying_errors()
        .run(pool)
        .await
        .unwrap_or_default();
    if let (false, Some(e)) = (drained.done, &drained.last_error) {
        sup.note(format!("last drain check failed: {e}"));
    }
    sup.note(drained.to_string());
    let drained = drained.done;
    let provider = boxoffice_payments::StripeClient::new(boxoffice_payments::StripeConfig {
        api_base: p.sim_base.clone(),
        secret_key: cfg.stripe_secret_key.clone(),
        timeout_ms: cfg.stripe_timeout_ms,
    })?;
    let window =
        boxoffice::reconcile::Window { since: p.run_started - chrono::Duration::minutes(1), until: None };
    let audit_opts = boxoffice::audit::AuditOptions {
        stuck_after_ms: 0,
        event: Some(p.event.0),
        provider: Ok((provider, window)),
        kafka: Ok(cfg.kafka().expect("set in prepare")),
        dlq_timeout: Duration::from_secs(30),
    };
    // The ledger read is retried: the database may still be refusing connections after the
    // last outage (or to a neighbour's load); a provider or broker failure is a result.
    let mut audited = boxoffice::audit::run(pool, &audit_opts).await;
    for _ in 0..5 {
        let Err(e) = &audited else { break };
        sup.note(format!("audit could not read the ledger, retrying: {e:#}"));
        tokio::time::sleep(Duration::from_secs(2)).await;
        audited = boxoffice::audit::run(pool, &audit_opts).await;
    }
    let report = audited?;
    pool.close().await;
    Ok(Audited { drained, report })
}

/// Phase 5: the report (JSON or text) and the exit code: 0 when every count is 0, 1 on any
/// violation, 2 when a check could not run.
fn report(run: &Run<'_>, p: &Prepared, stats: &buyers::BuyerStats, a: &Audited) -> anyhow::Result<i32> {
    let (args, sup, db_name, buyers_n) = (run.args, run.sup, run.db_name, p.buyers);
    let (audited, drained, event) = (&a.report, a.drained, p.event);
    let code = audited.exit_code();
    let counts = lock(&sup.counts).clone();
    let totals = &audited.totals;
    let report = json!({
        "seed": args.seed,
        "duration_s": args.duration.as_secs_f64(),
        "database": db_name,
        "event_id": event.0,
        "injected": counts,
        "events": lock(&sup.events).clone(),
        "buyers": buyers_n,
        "buyer_stats": stats,
        "orders_by_status": totals.orders_by_status,
        "tickets": totals.tickets,
        "seats_sold": totals.seats_sold,
        "captured": totals.captured,
        "refunds": totals.refunds,
        "drained": drained,
        "violations": audited.violations_json(),
        "violations_total": audited.total(),
        "checks": audited.to_json()["checks"].clone(),
        "exit_code": code,
        "elapsed_s": sup.started.elapsed().as_secs_f64(),
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!();
        println!("boxoffice chaos report: seed {}, {:.0}s of faults", args.seed, args.duration.as_secs_f64());
        let injected: Vec<String> = counts.iter().map(|(k, v)| format!("{k} {v}")).collect();
        println!("  injected        {}", injected.join(", "));
        println!(
            "  buyers          {buyers_n}: {} holds, {} authorized, {} declined, {} abandoned, {} timed out",
            stats.holds, stats.authorized, stats.declined, stats.abandoned, stats.timed_out
        );
        println!("  orders          {}", serde_json::to_string(&totals.orders_by_status)?);
        println!(
            "  tickets         {} (seats sold {}, captured {}, refunds {})",
            totals.tickets, totals.seats_sold, totals.captured, totals.refunds
        );
        println!("  drained         {drained}");
        print!("{}", boxoffice::audit::render(audited));
        match code {
            0 => println!("result: every invariant holds"),
            1 => println!("result: {} VIOLATION(S)", audited.total()),
            _ => println!("result: a check could not run"),
        }
    }
    Ok(code)
}

/// Aborts a task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Plays the schedule, then stops the faults: clears the simulator's faults and brings every
/// process back at once.
async fn execute(
    plan: &Plan,
    sup: &Supervisor,
    base: &Config,
    db_name: &str,
    http: &reqwest::Client,
    sim_base: &str,
    started: Instant,
) {
    for step in &plan.steps {
        tokio::time::sleep_until((started + Duration::from_millis(step.at_ms)).into()).await;
        let kind = step.action.kind();
        match &step.action {
            Action::Kill { process, down_ms, faults_on_restart } => {
                if sup.kill(process, Duration::from_millis(*down_ms), faults_on_restart).await {
                    sup.count(kind, 1);
                }
            }
            Action::RestartBroker { down_ms } => {
                if sup.kill("broker", Duration::from_millis(*down_ms), "").await {
                    sup.count(kind, 1);
                }
            }
            Action::TerminateBackends => match terminate_backends(base, db_name).await {
                Ok(n) => {
                    sup.count(kind, 1);
                    sup.count("backends_terminated", n as u64);
                    sup.note(format!("pg_terminate_backend: {n} connection(s) to {db_name}"));
                }
                Err(e) => sup.note(format!("pg_terminate_backend failed: {e:#}")),
            },
            Action::RestartPostgres => match restart_postgres(base).await {
                Ok(()) => {
                    sup.count(kind, 1);
                    sup.note("PostgreSQL restarted");
                }
                Err(e) => sup.note(format!("PostgreSQL restart failed: {e:#}")),
            },
            Action::StripeFaults { faults } => match set_sim_faults(http, sim_base, faults).await {
                Ok(()) => {
                    sup.count(kind, 1);
                    if faults.webhook_duplicates > 0 {
                        sup.count("duplicate_webhook_window", 1);
                    }
                    sup.note(format!("stripe faults on: {}", describe_faults(faults)));
                }
                Err(e) => sup.note(format!("setting stripe faults failed: {e:#}")),
            },
            Action::ClearStripeFaults => match set_sim_faults(http, sim_base, &Faults::default()).await {
                Ok(()) => sup.note("stripe faults off"),
                Err(e) => sup.note(format!("clearing stripe faults failed: {e:#}")),
            },
        }
    }
    tokio::time::sleep_until((started + Duration::from_millis(plan.duration_ms)).into()).await;
    // The faults stop: nothing is killed any more, the simulator behaves, everything comes back.
    let cleared = set_sim_faults(http, sim_base, &Faults::default()).await;
    sup.calm.store(true, Ordering::SeqCst);
    sup.note(match cleared {
        Ok(()) => "faults stopped: stripe faults cleared, every process restarted, draining".to_owned(),
        Err(e) => format!("faults stopped, but clearing stripe faults failed: {e:#}"),
    });
}

async fn set_sim_faults(http: &reqwest::Client, sim_base: &str, faults: &Faults) -> anyhow::Result<()> {
    http.post(format!("{sim_base}/_sim/faults")).json(faults).send().await?.error_for_status()?;
    Ok(())
}

/// Terminates every backend connected to `db_name`; returns how many.
async fn terminate_backends(base: &Config, db_name: &str) -> anyhow::Result<i64> {
    let mut conn = admin_connection(base).await?;
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
          WHERE datname = $1 AND pid <> pg_backend_pid()",
    )
    .bind(db_name)
    .fetch_one(&mut conn)
    .await?;
    Ok(n)
}

/// Restarts the local PostgreSQL cluster (Debian's `pg_ctlcluster <newest version> main
/// restart`) and waits until it accepts connections again.
async fn restart_postgres(base: &Config) -> anyhow::Result<()> {
    let version = std::fs::read_dir("/etc/postgresql")
        .context("PostgreSQL restart needs Debian's /etc/postgresql")?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .max()
        .context("no cluster under /etc/postgresql")?;
    let mut cmd = Command::new("pg_ctlcluster");
    cmd.args(["--skip-systemctl-redirect", &version.to_string(), "main", "restart"])
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    only_stdio(cmd.as_std_mut(), false);
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .context("pg_ctlcluster restart took over 60 s")??;
    anyhow::ensure!(
        out.status.success(),
        "pg_ctlcluster restart: {} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    let up = wait_until(Duration::from_secs(60), || async { admin_connection(base).await.is_ok() }).await;
    anyhow::ensure!(up, "PostgreSQL did not accept connections within 60 s of the restart");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plan_is_a_function_of_the_seed_and_covers_every_kind() {
        let d = Duration::from_secs(20);
        let a = plan(1, d, false);
        assert_eq!(a, plan(1, d, false));
        assert_ne!(a, plan(2, d, false));
        let kinds: Vec<&str> = a.steps.iter().map(|s| s.action.kind()).collect();
        for k in ["kill", "broker_restart", "terminate_backends", "stripe_fault_window"] {
            assert!(kinds.contains(&k), "{k} missing from {kinds:?}");
        }
        assert!(!kinds.contains(&"postgres_restart"), "only on request");
        assert!(plan(1, d, true).steps.iter().any(|s| s.action == Action::RestartPostgres));
        let dup = a.steps.iter().find_map(|s| match &s.action {
            Action::StripeFaults { faults } => Some(faults.webhook_duplicates),
            _ => None,
        });
        assert!(dup.unwrap_or(0) >= 1, "the first Stripe window duplicates webhooks");
        assert!(a.steps.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
        assert!(a.steps.iter().all(|s| s.at_ms <= d.as_millis() as u64));
    }

    #[test]
    fn every_fault_spec_the_plan_arms_is_valid() {
        for seed in 0..50 {
            let p = plan(seed, Duration::from_secs(120), true);
            let specs =
                p.initial_faults.values().cloned().chain(p.steps.iter().filter_map(|s| match &s.action {
                    Action::Kill { faults_on_restart, .. } => Some(faults_on_restart.clone()),
                    _ => None,
                }));
            for spec in specs {
                boxoffice_faults::validate(&spec).unwrap_or_else(|e| panic!("{spec}: {e}"));
            }
            let stripe: Vec<&Step> = p
                .steps
                .iter()
                .filter(|s| matches!(s.action, Action::StripeFaults { .. } | Action::ClearStripeFaults))
                .collect();
            assert!(
                stripe
                    .windows(2)
                    .all(|w| std::mem::discriminant(&w[0].action) != std::mem::discriminant(&w[1].action)),
                "stripe windows do not overlap (seed {seed})"
            );
        }
    }

    #[test]
    fn role_env_parses_key_value() {
        assert_eq!(
            parse_key_value("BOXOFFICE_LOG=debug=x").unwrap(),
            ("BOXOFFICE_LOG".into(), "debug=x".into())
        );
        assert!(parse_key_value("nope").is_err());
    }
}
