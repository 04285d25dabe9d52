//! The waiting room's release controller (design §3, §12, §16): it owns the rate `R` at which
//! a purchase cell admits queued buyers, and moves queued positions to admitted at that rate.
//!
//! The invariant it protects is the ledger's: PostgreSQL (and the saga behind it) stays within
//! the write rate it is proving, right now, that it sustains. `R` is not a fixed number: every
//! tick the controller reads live signals from the system itself and adapts `R` by an AIMD
//! law ([`next_rate`]), lowering it *before* the database degrades.
//!
//! **Signals** ([`Signal`]), each read by its own probe that may fail on its own (a failed
//! probe counts as over its threshold, for safety, and is counted in
//! `boxoffice_release_probe_errors_total{signal}`):
//!
//! | signal | how it is read | unit |
//! |---|---|---|
//! | `pg_commit_ms` | a one-row upsert into `release_probe`, commit included, timed | ms |
//! | `lock_waits` | `pg_stat_activity` rows of this database waiting on a `Lock` | sessions |
//! | `deadlocks` | growth of `pg_stat_database.deadlocks` of this database since the last tick | deadlocks |
//! | `connection_saturation` | client backends / `max_connections` (server-wide) | fraction |
//! | `outbox_age_ms` | age of the oldest unpublished outbox row, parked rows and the rows behind them excepted (`outbox::Backlog`) | ms |
//! | `consumer_lag` | max over the purchase topic's partitions and the groups `ticketing-saga`, `ticketing-payments`, `ticketing-tickets` of high-water − committed offset | messages |
//! | `active_holds` | holds in status `active` | holds |
//! | `expiry_delay_ms` | how far the oldest lapsed, still active hold is past its end | ms |
//! | `payable_delay_ms` | p99 over the active holds of the last 30 s of hold → payable (client secret shown); a hold not payable yet counts its age | ms |
//! | `authorization_wait_ms` | how long the oldest authorization reported in time has waited for its confirmation | ms |
//! | `never_payable_share` | of the active holds lapsing within 10 s unauthorized, the share never made payable (denominator ≥ 10) | fraction |
//!
//! The last three measure the business boundary end to end (case C19): a slow payment
//! provider, a lagging consumer or a noisy neighbour shows there before buyers lose holds,
//! so `R` falls while those already admitted are still served.
//!
//! **Law** (AIMD with a hold zone; [`next_rate`], pure and unit-tested). With thresholds `T`,
//! soft fraction `s` (default 0.8), step `a` and factor `b` (0 < b < 1), every tick:
//! 1. if any signal is over its threshold (`value > T`) or its probe failed:
//!    `R ← max(min, R·b)` and the offending signals are the reason (multiplicative decrease);
//! 2. else if any signal is in its soft zone (`value > s·T`): `R` holds — pressure is rising,
//!    so admitting more now would push it over;
//! 3. else `R ← min(max, R + a)` (additive increase).
//!
//! `R` always stays within `[min, max]`; a signal over its threshold never increases `R`; and
//! with every signal healthy `R` reaches `max` after `⌈(max − min) / a⌉` ticks. Additive
//! increase with multiplicative decrease converges to just under the rate at which a signal
//! crosses its soft zone, and backs off fast when a burst (a hot section, a slow disk, a
//! stalled relay) pushes one over.
//!
//! **One controller per cell.** Every API process runs a controller; each keeps one dedicated
//! PostgreSQL connection and tries the session-level advisory lock
//! `(hashtext('boxoffice.release'), hashtext(cell))` every tick. Only the holder samples and
//! releases; the others wait. The lock dies with the holder's connection (a crashed process, a
//! lost network), so another instance takes over on its next tick, starting again at the
//! initial rate. Probes run on that same connection under `statement_timeout`.
//!
//! **Release.** `R` is the cell's rate: it is divided evenly among the events that have people
//! queued, and each event's share accumulates fractional positions between ticks (an empty
//! queue banks nothing).
//!
//! **Status.** After every tick the leader upserts the cell's `release_status` row (R, this
//! tick's action and reasons, when and why R last moved, every signal against its threshold,
//! the consumer lag by group and partition, and each queued event's share, queue length and
//! admissions over the last [`ADMITTED_WINDOW`]) on its own connection; the operator's
//! dashboard reads it. A failed write is counted in `boxoffice_release_status_errors_total`
//! and changes nothing else: the row is a report, never an input of the law.
//!
//! Metrics (label `cell` on each): `boxoffice_release_rate_per_s` (R),
//! `boxoffice_release_event_rate_per_s{event}` (each event's share),
//! `boxoffice_release_signal{signal}` and `boxoffice_release_signal_threshold{signal}`,
//! `boxoffice_release_decreases_total{reason,cause}` (`cause` = `over_threshold` or
//! `probe_failed`), `boxoffice_release_probe_errors_total{signal}`,
//! `boxoffice_release_state` (1 increase, 0 hold, −1 decrease), `boxoffice_release_leader`
//! (1 on the lock holder), `boxoffice_release_sample_seconds` (the cost of one sampling of
//! every signal), `boxoffice_release_admitted_total` and
//! `boxoffice_release_allowance_total` (Σ R·Δt over ticks with a queue: admitted tracks it
//! within one position per event).

use boxoffice_bus::KafkaConfig;
use boxoffice_domain::{EventId, Topic};
use boxoffice_store::signals;
use boxoffice_waitroom::Waitroom;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How many signals there are.
pub const SIGNALS: usize = 11;
/// The window of `payable_delay_ms`: holds created this long ago at most, seconds.
pub const PAYABLE_WINDOW_S: f64 = 30.0;
/// The horizon of `never_payable_share`: holds lapsing within this long, seconds.
pub const NEVER_PAYABLE_HORIZON_S: f64 = 10.0;

/// One input of the control law.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Signal {
    /// Commit latency of a one-row write transaction, ms.
    PgCommitMs,
    /// Sessions of this database waiting on a heavyweight lock.
    LockWaits,
    /// Deadlocks detected in this database since the previous tick.
    Deadlocks,
    /// Client backends / `max_connections` of the server, 0..1.
    ConnectionSaturation,
    /// Age of the oldest unpublished outbox row, ms, parked rows and the rows behind them
    /// excepted: a fact the producer refused does not slow admissions.
    OutboxAgeMs,
    /// Max consumer lag over the purchase topic's partitions and consumer groups, messages.
    ConsumerLag,
    /// Holds in status `active`.
    ActiveHolds,
    /// How far the oldest active hold is past its expiry, ms (the expiry worker's delay).
    ExpiryDelayMs,
    /// p99 of hold → payable over the recent active holds, ms.
    PayableDelayMs,
    /// Age of the oldest authorization reported in time and not yet confirmed, ms.
    AuthorizationWaitMs,
    /// Share of the holds about to lapse unpaid that were never payable, 0–1.
    NeverPayableShare,
}

impl Signal {
    /// Every signal, in reporting order.
    pub const ALL: [Signal; SIGNALS] = [
        Signal::PgCommitMs,
        Signal::LockWaits,
        Signal::Deadlocks,
        Signal::ConnectionSaturation,
        Signal::OutboxAgeMs,
        Signal::ConsumerLag,
        Signal::ActiveHolds,
        Signal::ExpiryDelayMs,
        Signal::PayableDelayMs,
        Signal::AuthorizationWaitMs,
        Signal::NeverPayableShare,
    ];

    /// The name in metrics and logs (`signal` / `reason` label).
    pub fn name(self) -> &'static str {
        match self {
            Signal::PgCommitMs => "pg_commit_ms",
            Signal::LockWaits => "lock_waits",
            Signal::Deadlocks => "deadlocks",
            Signal::ConnectionSaturation => "connection_saturation",
            Signal::OutboxAgeMs => "outbox_age_ms",
            Signal::ConsumerLag => "consumer_lag",
            Signal::ActiveHolds => "active_holds",
            Signal::ExpiryDelayMs => "expiry_delay_ms",
            Signal::PayableDelayMs => "payable_delay_ms",
            Signal::AuthorizationWaitMs => "authorization_wait_ms",
            Signal::NeverPayableShare => "never_payable_share",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// What one probe read.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Reading {
    /// The measured value, in the signal's unit.
    Value(f64),
    /// The probe failed (error or timeout): counts as over the threshold.
    Failed,
    /// Not measured here (e.g. consumer lag without a broker configured): ignored by the law.
    Off,
}

/// One reading per [`Signal`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Signals([Reading; SIGNALS]);

impl Default for Signals {
    /// Every signal [`Reading::Off`].
    fn default() -> Self {
        Self([Reading::Off; SIGNALS])
    }
}

impl Signals {
    /// Every signal healthy at 0.
    pub fn zero() -> Self {
        Self([Reading::Value(0.0); SIGNALS])
    }

    /// The reading of `s`.
    pub fn get(&self, s: Signal) -> Reading {
        self.0[s.index()]
    }

    /// Sets the reading of `s`.
    pub fn set(&mut self, s: Signal, r: Reading) {
        self.0[s.index()] = r;
    }

    /// The same readings with `s` set to `r`.
    pub fn with(mut self, s: Signal, r: Reading) -> Self {
        self.set(s, r);
        self
    }
}

/// The threshold of each signal, in its unit: a value strictly above it is "over".
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    /// `pg_commit_ms`, ms.
    pub pg_commit_ms: f64,
    /// `lock_waits`, sessions.
    pub lock_waits: f64,
    /// `deadlocks` per tick (0: any deadlock is over).
    pub deadlocks: f64,
    /// `connection_saturation`, fraction of `max_connections`.
    pub connection_saturation: f64,
    /// `outbox_age_ms`, ms.
    pub outbox_age_ms: f64,
    /// `consumer_lag`, messages.
    pub consumer_lag: f64,
    /// `active_holds`, holds.
    pub active_holds: f64,
    /// `expiry_delay_ms`, ms.
    pub expiry_delay_ms: f64,
    /// `payable_delay_ms`, ms.
    pub payable_delay_ms: f64,
    /// `authorization_wait_ms`, ms.
    pub authorization_wait_ms: f64,
    /// `never_payable_share`, fraction.
    pub never_payable_share: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Self {
            pg_commit_ms: 50.0,
            lock_waits: 10.0,
            deadlocks: 0.0,
            connection_saturation: 0.9,
            outbox_age_ms: 5_000.0,
            consumer_lag: 5_000.0,
            active_holds: 50_000.0,
            expiry_delay_ms: 10_000.0,
            payable_delay_ms: 15_000.0,
            authorization_wait_ms: 20_000.0,
            never_payable_share: 0.05,
        }
    }
}

impl Thresholds {
    /// The threshold of `s`.
    pub fn of(&self, s: Signal) -> f64 {
        match s {
            Signal::PgCommitMs => self.pg_commit_ms,
            Signal::LockWaits => self.lock_waits,
            Signal::Deadlocks => self.deadlocks,
            Signal::ConnectionSaturation => self.connection_saturation,
            Signal::OutboxAgeMs => self.outbox_age_ms,
            Signal::ConsumerLag => self.consumer_lag,
            Signal::ActiveHolds => self.active_holds,
            Signal::ExpiryDelayMs => self.expiry_delay_ms,
            Signal::PayableDelayMs => self.payable_delay_ms,
            Signal::AuthorizationWaitMs => self.authorization_wait_ms,
            Signal::NeverPayableShare => self.never_payable_share,
        }
    }
}

/// Bounds and gains of the law.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    /// Lowest rate, positions/s (> 0: a queue always moves, however slowly).
    pub min_per_s: f64,
    /// Highest rate, positions/s (≥ `min_per_s`).
    pub max_per_s: f64,
    /// Additive increase per healthy tick, positions/s (> 0).
    pub step_per_s: f64,
    /// Multiplicative decrease when a signal is over (0 < factor < 1).
    pub decrease_factor: f64,
    /// A signal above this fraction of its threshold holds `R` (0 < fraction ≤ 1; 1 turns the
    /// hold zone off).
    pub soft_fraction: f64,
}

impl Default for Limits {
    fn default() -> Self {
        Self { min_per_s: 1.0, max_per_s: 50.0, step_per_s: 5.0, decrease_factor: 0.5, soft_fraction: 0.8 }
    }
}

/// What one tick of the law did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Every signal healthy: `R` grew by the step (or stayed at max).
    Increase,
    /// A signal in its soft zone: `R` held.
    Hold,
    /// A signal over its threshold or a failed probe: `R` shrank by the factor (or stayed at min).
    Decrease,
}

impl Action {
    /// The value of the `boxoffice_release_state` gauge: 1, 0, −1.
    pub fn gauge(self) -> f64 {
        match self {
            Action::Increase => 1.0,
            Action::Hold => 0.0,
            Action::Decrease => -1.0,
        }
    }
}

/// The law's answer: the next rate and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The next rate, positions/s, within `[min_per_s, max_per_s]`.
    pub rate: f64,
    /// What happened.
    pub action: Action,
    /// Signals over their threshold (the reasons of a decrease).
    pub over: Vec<Signal>,
    /// Signals whose probe failed (also reasons of a decrease).
    pub failed: Vec<Signal>,
    /// Signals in their soft zone (the reasons of a hold).
    pub soft: Vec<Signal>,
}

impl Decision {
    /// The signals behind the action: over or failed for a decrease, soft for a hold, none
    /// for an increase.
    pub fn reasons(&self) -> Vec<Signal> {
        match self.action {
            Action::Decrease => self.over.iter().chain(&self.failed).copied().collect(),
            Action::Hold => self.soft.clone(),
            Action::Increase => Vec::new(),
        }
    }
}

/// The control law (AIMD with a hold zone; see the module docs): the rate after one tick at
/// `rate` given `signals`. Pure: no clock, no I/O. A value that is not a number counts as a
/// failed probe.
pub fn next_rate(rate: f64, signals: &Signals, thresholds: &Thresholds, limits: &Limits) -> Decision {
    let (lo, hi) = (limits.min_per_s, limits.max_per_s.max(limits.min_per_s));
    let rate = if rate.is_finite() { rate.clamp(lo, hi) } else { lo };
    let (mut over, mut failed, mut soft) = (Vec::new(), Vec::new(), Vec::new());
    for s in Signal::ALL {
        let t = thresholds.of(s);
        match signals.get(s) {
            Reading::Off => {}
            Reading::Failed => failed.push(s),
            Reading::Value(v) if v.is_nan() => failed.push(s),
            Reading::Value(v) if v > t => over.push(s),
            Reading::Value(v) if v > t * limits.soft_fraction => soft.push(s),
            Reading::Value(_) => {}
        }
    }
    let (rate, action) = if !over.is_empty() || !failed.is_empty() {
        ((rate * limits.decrease_factor).clamp(lo, hi), Action::Decrease)
    } else if !soft.is_empty() {
        (rate, Action::Hold)
    } else {
        ((rate + limits.step_per_s).clamp(lo, hi), Action::Increase)
    };
    Decision { rate, action, over, failed, soft }
}

/// Everything the controller needs besides its connections.
#[derive(Debug, Clone)]
pub struct ReleaseSettings {
    /// The purchase cell this controller serves (advisory-lock key and `cell` label).
    pub cell: String,
    /// The rate a new lock holder starts at, positions/s (within the limits).
    pub initial_per_s: f64,
    /// Bounds and gains of the law.
    pub limits: Limits,
    /// Thresholds of the signals.
    pub thresholds: Thresholds,
    /// Tick of the loop (sample, decide, release), ms.
    pub tick_ms: u64,
    /// Bound of each probe, ms (PostgreSQL `statement_timeout` and the broker calls); a
    /// probe past it has failed.
    pub probe_timeout_ms: u64,
}

impl Default for ReleaseSettings {
    fn default() -> Self {
        Self {
            cell: "cell-1".into(),
            initial_per_s: 10.0,
            limits: Limits::default(),
            thresholds: Thresholds::default(),
            tick_ms: 1_000,
            probe_timeout_ms: 2_000,
        }
    }
}

/// What the controller last did, published after every tick.
#[derive(Debug, Clone, PartialEq)]
pub struct Status {
    /// Whether this instance holds the cell's advisory lock.
    pub leader: bool,
    /// Current `R`, positions/s (of the last tick as leader).
    pub rate_per_s: f64,
    /// The last decision, as leader.
    pub decision: Option<Decision>,
    /// The last readings, as leader.
    pub signals: Signals,
    /// Ticks run as leader.
    pub ticks: u64,
    /// Positions admitted by this instance.
    pub admitted: u64,
    /// Σ R·Δt over ticks with a queue, positions: `admitted` stays within one position per
    /// event of it while the queues never run dry.
    pub allowance: f64,
    /// Decreases per reason (signal), since start.
    pub decreases: HashMap<Signal, u64>,
    /// How long the last sampling of every signal took, ms (the controller's own cost).
    pub sample_ms: f64,
}

/// Consumer lag of the purchase topic, in messages.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConsumerLag {
    /// Max over groups and partitions of high-water − committed (the controller's signal).
    pub max_partition: i64,
    /// Max over groups of the lag summed over the group's partitions (a group's backlog).
    pub max_group_total: i64,
    /// Every (group, partition) with a lag above 0, largest first (the operator's view).
    pub by_partition: Vec<PartitionLag>,
}

/// One consumer group's lag on one partition of the purchase topic.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PartitionLag {
    /// The consumer group (prefixed as on the broker).
    pub group: String,
    /// The partition.
    pub partition: i32,
    /// High-water − committed, messages.
    pub lag: i64,
}

/// Reads consumer lag from the broker: committed offsets of each group against the
/// high-water marks of the purchase topic, without joining the groups. Blocking
/// (librdkafka): call it on a blocking thread.
pub struct ConsumerLagProbe {
    topic: String,
    groups: Vec<(String, BaseConsumer)>,
}

impl ConsumerLagProbe {
    /// A probe of the groups of `consumers` (consumer names, e.g. [`LAG_CONSUMERS`]).
    ///
    /// # Errors
    /// When a Kafka client cannot be created from `cfg`.
    pub fn new(cfg: &KafkaConfig, consumers: &[&str]) -> anyhow::Result<Self> {
        let groups = consumers
            .iter()
            .map(|c| {
                let group = cfg.group(c);
                // A plain client with the group's id: it never joins the group (no subscribe),
                // it only fetches the group's committed offsets.
                let consumer: BaseConsumer = cfg
                    .client_config()
                    .set("group.id", &group)
                    .set("enable.auto.commit", "false")
                    .create()?;
                Ok((group, consumer))
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self { topic: cfg.topic(Topic::Purchase.name()), groups })
    }

    /// The lag now: high-water − committed per group and partition (an uncommitted partition
    /// counts from its low-water mark: the consumers start at `earliest`).
    ///
    /// # Errors
    /// When the broker does not answer within `timeout` per call.
    pub fn read(&self, timeout: Duration) -> anyhow::Result<ConsumerLag> {
        let Some((_, any)) = self.groups.first() else { return Ok(ConsumerLag::default()) };
        let md = any.fetch_metadata(Some(&self.topic), timeout)?;
        let partitions: Vec<i32> =
            md.topics().iter().flat_map(|t| t.partitions().iter().map(|p| p.id())).collect();
        anyhow::ensure!(!partitions.is_empty(), "topic {} has no partitions", self.topic);
        let mut marks = HashMap::new();
        for p in &partitions {
            marks.insert(*p, any.fetch_watermarks(&self.topic, *p, timeout)?);
        }
        let (mut max, mut max_total) = (0i64, 0i64);
        let mut by_partition = Vec::new();
        for (group, c) in &self.groups {
            let mut tpl = TopicPartitionList::new();
            for p in &partitions {
                tpl.add_partition(&self.topic, *p);
            }
            let committed = c
                .committed_offsets(tpl, timeout)
                .map_err(|e| anyhow::anyhow!("committed offsets of {group}: {e}"))?;
            let mut total = 0i64;
            for e in committed.elements() {
                let (low, high) = marks.get(&e.partition()).copied().unwrap_or((0, 0));
                let from = match e.offset() {
                    Offset::Offset(o) => o,
                    _ => low,
                };
                let lag = (high - from).max(0);
                max = max.max(lag);
                total += lag;
                if lag > 0 {
                    by_partition.push(PartitionLag { group: group.clone(), partition: e.partition(), lag });
                }
            }
            max_total = max_total.max(total);
        }
        by_partition.sort_by(|a, b| b.lag.cmp(&a.lag).then(a.partition.cmp(&b.partition)));
        Ok(ConsumerLag { max_partition: max, max_group_total: max_total, by_partition })
    }
}

/// The release controller of one purchase cell (see the module docs). Build it with
/// [`Controller::new`], run it with [`Controller::run`].
pub struct Controller {
    connect: PgConnectOptions,
    room: Waitroom,
    settings: ReleaseSettings,
    lag: Option<Arc<ConsumerLagProbe>>,
    status: watch::Sender<Status>,
}

/// The consumer groups whose lag the controller reads (the purchase topic's consumers).
pub const LAG_CONSUMERS: [&str; 3] = [crate::saga::NAME, crate::payment::NAME, crate::tickets::NAME];

impl Controller {
    /// A controller on `connect` (one dedicated connection, opened by [`Controller::run`]),
    /// releasing from `room`; with `kafka`, consumer lag is read from that broker, otherwise
    /// that signal is [`Reading::Off`]. Returns the status receiver too.
    ///
    /// # Errors
    /// A Kafka client that cannot be built (bad settings).
    pub fn new(
        connect: PgConnectOptions,
        room: Waitroom,
        kafka: Option<&KafkaConfig>,
        settings: ReleaseSettings,
    ) -> anyhow::Result<(Self, watch::Receiver<Status>)> {
        let lag = kafka.map(|k| ConsumerLagProbe::new(k, &LAG_CONSUMERS)).transpose()?.map(Arc::new);
        let (status, rx) = watch::channel(Status {
            leader: false,
            rate_per_s: settings.initial_per_s,
            decision: None,
            signals: Signals::default(),
            ticks: 0,
            admitted: 0,
            allowance: 0.0,
            decreases: HashMap::new(),
            sample_ms: 0.0,
        });
        Ok((Self { connect, room, settings, lag, status }, rx))
    }

    /// Runs until `shutdown`: tries the cell's advisory lock every tick; while holding it,
    /// samples, decides and releases every tick. Errors are logged and retried next tick;
    /// losing the connection gives the lock up (another instance takes over).
    pub async fn run(self, shutdown: CancellationToken) {
        let tick = Duration::from_millis(self.settings.tick_ms.max(1));
        let mut interval = tokio::time::interval(tick);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let cell = self.settings.cell.clone();
        for s in Signal::ALL {
            metrics::gauge!("boxoffice_release_signal_threshold", "cell" => cell.clone(), "signal" => s.name())
                .set(self.settings.thresholds.of(s));
        }
        let mut conn: Option<PgConnection> = None;
        let mut leading: Option<Leader> = None;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = interval.tick() => {}
            }
            if conn.is_none() {
                match self.open().await {
                    Ok(c) => conn = Some(c),
                    Err(e) => {
                        tracing::warn!(cell = %cell, error = %e, "release controller: cannot connect to PostgreSQL");
                        continue;
                    }
                }
            }
            let c = conn.as_mut().expect("connected");
            if leading.is_none() {
                match self.try_lock(c).await {
                    Ok(true) => {
                        tracing::info!(cell = %cell, "release controller: holding the cell's lock, releasing");
                        leading = Some(Leader::new(self.settings.initial_per_s, &self.settings.limits));
                        metrics::gauge!("boxoffice_release_leader", "cell" => cell.clone()).set(1.0);
                    }
                    Ok(false) => {
                        self.status.send_modify(|s| s.leader = false);
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!(cell = %cell, error = %e, "release controller: advisory lock attempt failed");
                        conn = None;
                        continue;
                    }
                }
            }
            let leader = leading.as_mut().expect("leading");
            let started = Instant::now();
            let (signals, broken) = self.sample(conn.as_mut().expect("connected"), leader).await;
            let sample_ms = started.elapsed().as_secs_f64() * 1_000.0;
            metrics::histogram!("boxoffice_release_sample_seconds", "cell" => cell.clone())
                .record(sample_ms / 1_000.0);
            if broken {
                // The connection (and with it the lock) may be gone: give it up and retake it
                // from scratch; meanwhile another instance may take over.
                tracing::warn!(cell = %cell, "release controller: lost the probe connection, giving up the lock");
                conn = None;
                leading = None;
                metrics::gauge!("boxoffice_release_leader", "cell" => cell.clone()).set(0.0);
                self.status.send_modify(|s| s.leader = false);
                continue;
            }
            self.tick(conn.as_mut().expect("connected"), leader, signals, sample_ms, tick).await;
        }
        metrics::gauge!("boxoffice_release_leader", "cell" => cell).set(0.0);
        self.status.send_modify(|s| s.leader = false);
        // Dropping the connection ends the session and with it the advisory lock.
        if let Some(c) = conn {
            let _ = tokio::time::timeout(Duration::from_secs(1), c.close()).await;
        }
    }

    async fn open(&self) -> Result<PgConnection, sqlx::Error> {
        let opts = self
            .connect
            .clone()
            .application_name("boxoffice-release")
            .options([("statement_timeout", self.settings.probe_timeout_ms.to_string())]);
        tokio::time::timeout(self.bound(), opts.connect()).await.map_err(|_| timed_out())?
    }

    fn bound(&self) -> Duration {
        Duration::from_millis(self.settings.probe_timeout_ms + 1_000)
    }

    async fn try_lock(&self, c: &mut PgConnection) -> Result<bool, sqlx::Error> {
        let q = signals::try_leader_lock(c, &self.settings.cell);
        tokio::time::timeout(self.bound(), q).await.map_err(|_| timed_out())?
    }

    /// Reads every signal; the flag says the connection is no longer usable.
    async fn sample(&self, c: &mut PgConnection, leader: &mut Leader) -> (Signals, bool) {
        let mut s = Signals::default();
        let mut broken = false;
        let bound = self.bound();
        let cell = self.settings.cell.as_str();
        macro_rules! probe {
            ($signal:expr, $fut:expr) => {{
                let r: Result<Result<f64, sqlx::Error>, _> = tokio::time::timeout(bound, $fut).await;
                let reading = match r {
                    Ok(Ok(v)) => Reading::Value(v),
                    Ok(Err(e)) => {
                        broken |= is_connection_error(&e);
                        tracing::debug!(signal = $signal.name(), error = %e, "release probe failed");
                        Reading::Failed
                    }
                    Err(_) => {
                        // Cancelled mid-query: the connection is in an unknown state.
                        broken = true;
                        Reading::Failed
                    }
                };
                s.set($signal, reading);
            }};
        }
        probe!(Signal::PgCommitMs, signals::commit_latency_ms(&mut *c, cell));
        if broken {
            return (s, true);
        }
        probe!(Signal::LockWaits, signals::lock_waits(&mut *c));
        probe!(Signal::Deadlocks, async {
            let total = signals::deadlocks_total(&mut *c).await?;
            // The first reading after taking the lock is a baseline, not a burst.
            let delta = leader.last_deadlocks.map(|prev| (total - prev).max(0.0)).unwrap_or(0.0);
            leader.last_deadlocks = Some(total);
            Ok(delta)
        });
        probe!(Signal::ConnectionSaturation, signals::connection_saturation(&mut *c));
        probe!(Signal::OutboxAgeMs, async {
            Ok(boxoffice_store::outbox::backlog(&mut *c).await?.oldest_age_ms as f64)
        });
        probe!(Signal::ActiveHolds, signals::active_holds(&mut *c));
        probe!(Signal::ExpiryDelayMs, signals::expiry_delay_ms(&mut *c));
        probe!(Signal::PayableDelayMs, signals::payable_delay_p99_ms(&mut *c, PAYABLE_WINDOW_S));
        probe!(Signal::AuthorizationWaitMs, signals::authorization_wait_ms(&mut *c));
        probe!(Signal::NeverPayableShare, signals::never_payable_share(&mut *c, NEVER_PAYABLE_HORIZON_S));
        if let Some(lag) = &self.lag {
            let (lag, t) = (lag.clone(), Duration::from_millis(self.settings.probe_timeout_ms));
            let r = tokio::time::timeout(bound, tokio::task::spawn_blocking(move || lag.read(t))).await;
            let reading = match r {
                Ok(Ok(Ok(v))) => {
                    leader.lag_by_partition = v.by_partition;
                    Reading::Value(v.max_partition as f64)
                }
                Ok(Ok(Err(e))) => {
                    tracing::debug!(signal = "consumer_lag", error = %e, "release probe failed");
                    Reading::Failed
                }
                _ => Reading::Failed,
            };
            s.set(Signal::ConsumerLag, reading);
        }
        (s, broken)
    }

    /// Decides the next rate from `signals`, records it, releases the tick's share and
    /// writes the cell's `release_status` row on `c`.
    async fn tick(
        &self,
        c: &mut PgConnection,
        leader: &mut Leader,
        signals: Signals,
        sample_ms: f64,
        tick: Duration,
    ) {
        let cell = self.settings.cell.clone();
        let d = next_rate(leader.rate, &signals, &self.settings.thresholds, &self.settings.limits);
        for sig in Signal::ALL {
            match signals.get(sig) {
                Reading::Value(v) => {
                    metrics::gauge!("boxoffice_release_signal", "cell" => cell.clone(), "signal" => sig.name())
                        .set(v)
                }
                Reading::Failed => metrics::counter!(
                    "boxoffice_release_probe_errors_total", "cell" => cell.clone(), "signal" => sig.name()
                )
                .increment(1),
                Reading::Off => {}
            }
        }
        if d.action == Action::Decrease {
            for (sigs, cause) in [(&d.over, "over_threshold"), (&d.failed, "probe_failed")] {
                for sig in sigs {
                    metrics::counter!(
                        "boxoffice_release_decreases_total",
                        "cell" => cell.clone(), "reason" => sig.name(), "cause" => cause
                    )
                    .increment(1);
                }
            }
            if leader.last_action != Some(Action::Decrease) {
                let reasons: Vec<&str> = d.over.iter().chain(&d.failed).map(|s| s.name()).collect();
                tracing::info!(cell = %cell, rate_per_s = d.rate, reasons = ?reasons, "release rate decreasing");
            }
        }
        leader.last_action = Some(d.action);
        if d.rate != leader.rate {
            leader.moved = Some((chrono::Utc::now(), d.action, d.reasons()));
        }
        leader.rate = d.rate;
        metrics::gauge!("boxoffice_release_rate_per_s", "cell" => cell.clone()).set(d.rate);
        metrics::gauge!("boxoffice_release_state", "cell" => cell.clone()).set(d.action.gauge());

        // Release the share of this tick. Δt is measured, but capped at two ticks so a stall
        // (a slow probe, a pause) does not turn into a burst.
        let now = Instant::now();
        let dt = now.duration_since(leader.last_release).min(tick * 2).as_secs_f64();
        leader.last_release = now;
        let (admitted, allowance) = self.release(leader, d.rate, dt).await;
        metrics::counter!("boxoffice_release_admitted_total", "cell" => cell.clone()).increment(admitted);
        self.status.send_modify(|s| {
            s.leader = true;
            s.rate_per_s = d.rate;
            s.signals = signals;
            s.sample_ms = sample_ms;
            s.ticks += 1;
            s.admitted += admitted;
            s.allowance += allowance;
            if d.action == Action::Decrease {
                for sig in d.over.iter().chain(&d.failed) {
                    *s.decreases.entry(*sig).or_default() += 1;
                }
            }
            s.decision = Some(d.clone());
        });
        leader.last_decision = Some(d);
        metrics::gauge!("boxoffice_release_allowance_total", "cell" => cell.clone())
            .set(self.status.borrow().allowance);
        let row = self.status_row(leader, &signals);
        let write = boxoffice_store::operator::record_release_status(c, &row);
        match tokio::time::timeout(self.bound(), write).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                metrics::counter!("boxoffice_release_status_errors_total", "cell" => cell).increment(1);
                tracing::debug!(error = %e, "release controller: cannot record its status");
            }
            Err(_) => {
                metrics::counter!("boxoffice_release_status_errors_total", "cell" => cell).increment(1);
                tracing::debug!("release controller: recording its status timed out");
            }
        }
    }

    /// The cell's `release_status` row after this tick (the operator's dashboard reads it).
    fn status_row(&self, leader: &Leader, signals: &Signals) -> boxoffice_store::operator::ReleaseStatus {
        let t = &self.settings.thresholds;
        let soft = self.settings.limits.soft_fraction;
        let list: Vec<serde_json::Value> = Signal::ALL
            .iter()
            .map(|s| {
                let threshold = t.of(*s);
                let (value, state) = match signals.get(*s) {
                    Reading::Value(v) if v.is_nan() => (None, "failed"),
                    Reading::Value(v) if v > threshold => (Some(v), "over"),
                    Reading::Value(v) if v > threshold * soft => (Some(v), "soft"),
                    Reading::Value(v) => (Some(v), "ok"),
                    Reading::Failed => (None, "failed"),
                    Reading::Off => (None, "off"),
                };
                serde_json::json!({"name": s.name(), "value": value, "threshold": threshold, "state": state})
            })
            .collect();
        let now = Instant::now();
        let events: serde_json::Map<String, serde_json::Value> = leader
            .events
            .iter()
            .map(|(e, q)| {
                let window = now.saturating_duration_since(leader.since_instant).min(ADMITTED_WINDOW);
                let per_s = q.admitted_in(now) as f64 / window.as_secs_f64().max(1.0);
                (
                    e.0.to_string(),
                    serde_json::json!({
                        "rate_per_s": q.rate_per_s,
                        "queued": q.queued,
                        "pre_queued": q.pre_queued,
                        "admitted_live": q.admitted_live,
                        "admitted_per_s": per_s,
                        "admitted_total": q.admitted_total,
                    }),
                )
            })
            .collect();
        let (action, reasons) = leader
            .last_decision
            .as_ref()
            .map(|d| (action_name(d.action), names(&d.reasons())))
            .unwrap_or(("hold", Vec::new()));
        boxoffice_store::operator::ReleaseStatus {
            cell: self.settings.cell.clone(),
            rate_per_s: leader.rate,
            action: action.to_owned(),
            reasons,
            moved_at: leader.moved.as_ref().map(|m| m.0),
            moved_action: leader.moved.as_ref().map(|m| action_name(m.1).to_owned()),
            moved_reasons: leader.moved.as_ref().map(|m| names(&m.2)).unwrap_or_default(),
            signals: sqlx::types::Json(serde_json::json!({
                "signals": list,
                "consumer_lag_by_partition": leader.lag_by_partition,
            })),
            event_rates: sqlx::types::Json(serde_json::Value::Object(events)),
            min_per_s: self.settings.limits.min_per_s,
            max_per_s: self.settings.limits.max_per_s,
            leader_since: leader.since,
            updated_at: chrono::Utc::now(),
        }
    }

    /// How long the rate recorded with a release stays valid for the queue's wait estimates:
    /// three ticks, at least 10 s.
    fn rate_validity(&self) -> Duration {
        Duration::from_millis(self.settings.tick_ms.saturating_mul(3)).max(Duration::from_secs(10))
    }

    /// Releases `rate·dt` positions split evenly among the events with a queue. Returns the
    /// positions admitted and the allowance granted.
    async fn release(&self, leader: &mut Leader, rate: f64, dt: f64) -> (u64, f64) {
        let events = match self.room.active_events().await {
            Ok(e) => e,
            Err(e) => {
                tracing::debug!(error = %e, "release controller: cannot list queues");
                return (0, 0.0);
            }
        };
        leader.carry.retain(|e, _| events.contains(e));
        leader.events.retain(|e, _| events.contains(e));
        if events.is_empty() {
            return (0, 0.0);
        }
        let share = rate / events.len() as f64;
        let (mut admitted, mut allowance) = (0u64, 0.0);
        for event in events {
            metrics::gauge!(
                "boxoffice_release_event_rate_per_s",
                "cell" => self.settings.cell.clone(), "event" => event.0.to_string()
            )
            .set(share);
            let carry = leader.carry.entry(event).or_insert(0.0);
            *carry += share * dt;
            // Called every tick, with nothing to admit too: the rate it records is what the
            // queue is told about its wait, and it must stay fresh when R is low.
            let n = carry.floor().min(u32::MAX as f64) as u32;
            match self.room.release(event, n, Some((share, self.rate_validity()))).await {
                Ok(r) => {
                    allowance += share * dt;
                    *carry -= n as f64;
                    admitted += r.admitted.len() as u64;
                    leader.events.entry(event).or_default().record(share, &r);
                    // An empty queue does not bank releases for later.
                    if r.queued == 0 {
                        *carry = 0.0;
                    }
                }
                Err(e) => {
                    tracing::debug!(event.id = %event.0, error = %e, "release controller: release failed");
                    *carry -= share * dt;
                    break;
                }
            }
        }
        (admitted, allowance)
    }
}

/// The window of each event's `admitted_per_s` in `release_status`.
pub const ADMITTED_WINDOW: Duration = Duration::from_secs(10);

/// The state of the lock holder.
struct Leader {
    rate: f64,
    last_deadlocks: Option<f64>,
    last_action: Option<Action>,
    last_decision: Option<Decision>,
    /// When R last changed value, by which action, for which signals.
    moved: Option<(chrono::DateTime<chrono::Utc>, Action, Vec<Signal>)>,
    last_release: Instant,
    carry: HashMap<EventId, f64>,
    /// Each queued event's share, queue and admissions, as of the last release.
    events: HashMap<EventId, EventQueue>,
    /// The last lag probe's breakdown.
    lag_by_partition: Vec<PartitionLag>,
    since: chrono::DateTime<chrono::Utc>,
    since_instant: Instant,
}

impl Leader {
    fn new(initial: f64, limits: &Limits) -> Self {
        Self {
            rate: initial.clamp(limits.min_per_s, limits.max_per_s.max(limits.min_per_s)),
            last_deadlocks: None,
            last_action: None,
            last_decision: None,
            moved: None,
            last_release: Instant::now(),
            carry: HashMap::new(),
            events: HashMap::new(),
            lag_by_partition: Vec::new(),
            since: chrono::Utc::now(),
            since_instant: Instant::now(),
        }
    }
}

/// One queued event as the leader last released it.
#[derive(Default)]
struct EventQueue {
    rate_per_s: f64,
    queued: u64,
    pre_queued: u64,
    admitted_live: u64,
    admitted_total: u64,
    /// Admissions of the last [`ADMITTED_WINDOW`], per release.
    recent: std::collections::VecDeque<(Instant, u64)>,
}

impl EventQueue {
    fn record(&mut self, share: f64, r: &boxoffice_waitroom::Released) {
        let now = Instant::now();
        let n = r.admitted.len() as u64;
        self.rate_per_s = share;
        self.queued = r.queued;
        self.pre_queued = r.pre_queued;
        self.admitted_live = r.admitted_live;
        self.admitted_total += n;
        if n > 0 {
            self.recent.push_back((now, n));
        }
        while self.recent.front().is_some_and(|(t, _)| now.duration_since(*t) > ADMITTED_WINDOW) {
            self.recent.pop_front();
        }
    }

    /// Positions admitted within [`ADMITTED_WINDOW`] before `now`.
    fn admitted_in(&self, now: Instant) -> u64 {
        self.recent
            .iter()
            .filter(|(t, _)| now.saturating_duration_since(*t) <= ADMITTED_WINDOW)
            .map(|(_, n)| n)
            .sum()
    }
}

fn action_name(a: Action) -> &'static str {
    match a {
        Action::Increase => "increase",
        Action::Hold => "hold",
        Action::Decrease => "decrease",
    }
}

fn names(signals: &[Signal]) -> Vec<String> {
    signals.iter().map(|s| s.name().to_owned()).collect()
}

/// A call that outlived its bound (the connection is then dropped).
fn timed_out() -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "release controller: PostgreSQL call timed out",
    ))
}

/// Whether `e` means the session is gone (and with it the advisory lock).
fn is_connection_error(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) | sqlx::Error::PoolClosed)
}

#[cfg(test)]
mod tests;
