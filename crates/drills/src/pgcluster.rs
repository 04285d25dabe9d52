//! The PostgreSQL pair of the warm-region failover drill, on one machine: a primary
//! PostgreSQL 15 cluster and an asynchronous streaming replica of it, both created here and
//! removed afterwards, with a TCP relay between them that can cut replication.
//!
//! Owns, per [`PgPair::create`]:
//!
//! - two Debian clusters (`pg_createcluster`), `{prefix}_{pid}_{n}_p` (the primary) and
//!   `{prefix}_{pid}_{n}_r` (the replica), unique per process and call, each on a free
//!   loopback port, with data under `/var/lib/postgresql/15/NAME`, configuration under
//!   `/etc/postgresql/15/NAME` and the log in `/var/log/postgresql/postgresql-15-NAME.log`;
//!   they are created with `start.conf` `manual`, so a reboot never starts a leftover;
//! - the drill's settings ([`SETTINGS`]) in the primary's `postgresql.auto.conf`, which the
//!   base backup carries to the replica;
//! - a physical replication slot on the primary named like the replica, which keeps the WAL
//!   the replica has not confirmed (up to `max_slot_wal_keep_size`) and tells the primary
//!   where the replica was when it is disconnected;
//! - the relay, a [`KillSwitch`] on a free loopback port forwarding to the primary: the base
//!   backup is taken through it and the replica's `primary_conninfo` names its port, so
//!   [`PgPair::cut_replication`] is a network partition between the two regions while both
//!   servers stay up and reachable directly by clients.
//!
//! [`PgPair::remove`] (or, best-effort, dropping the pair, or an error or cancellation inside
//! [`PgPair::create`]) stops both servers at once and drops both clusters; a later `create`
//! with the same prefix drops what a killed process left behind (clusters of this prefix
//! whose process id is no longer alive).
//!
//! Needs root (as the drill runs): the Debian tools create clusters under root-owned
//! directories, and the server programs run as the clusters' owner (`postgres`). The servers
//! are started with `pg_ctl start -w` as that owner rather than `pg_ctlcluster start`, whose
//! readiness probe alone takes at least 2 s; they are stopped with `pg_ctlcluster`.

use anyhow::{bail, ensure, Context};
use boxoffice_harness::killswitch::KillSwitch;
use sqlx::postgres::{PgConnectOptions, PgSslMode};
use sqlx::{Connection, PgConnection};
use std::fmt;
use std::net::SocketAddr;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::str::FromStr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The PostgreSQL major version of every cluster created here.
pub const PG_VERSION: u32 = 15;

/// The settings of both clusters (`postgresql.auto.conf`), as `(name, value)` with the value
/// as written in the file. Loopback only, enough connections for a deployment of every role,
/// small shared buffers (two servers beside the machine's own), replication with a slot
/// whose retained WAL is capped, the replica retrying a lost connection every second and
/// reporting its position every second, no TLS on loopback, and the data directory synced
/// with one `syncfs` rather than file by file at crash recovery (starting after
/// [`Cluster::stop_immediate`] or from a base backup). `fsync` stays on.
pub const SETTINGS: &[(&str, &str)] = &[
    ("listen_addresses", "'127.0.0.1'"),
    ("max_connections", "150"),
    ("shared_buffers", "'16MB'"),
    ("wal_level", "'replica'"),
    ("max_wal_senders", "4"),
    ("max_replication_slots", "4"),
    ("max_slot_wal_keep_size", "'1GB'"),
    ("hot_standby", "on"),
    ("wal_retrieve_retry_interval", "'1s'"),
    ("wal_receiver_status_interval", "'1s'"),
    ("ssl", "off"),
    ("recovery_init_sync_method", "'syncfs'"),
];

/// How long [`PgPair::create`] waits for the replica to stream.
const STREAMING_TIMEOUT: Duration = Duration::from_secs(60);
/// Bound on connecting to a cluster.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on `pg_ctl start -w`, seconds.
const START_TIMEOUT_S: &str = "60";

/// Makes cluster names unique within the process.
static PAIRS: AtomicU32 = AtomicU32::new(0);

/// A write-ahead log position (`pg_lsn`): a byte offset into the WAL, written `X/Y` in hex.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lsn(pub u64);

impl Lsn {
    /// Bytes of WAL from `earlier` to `self` (negative when `earlier` is later), as
    /// `pg_wal_lsn_diff(self, earlier)` computes them; see [`Cluster::wal_lsn_diff`] for the
    /// server's own.
    pub fn bytes_since(self, earlier: Lsn) -> i128 {
        i128::from(self.0) - i128::from(earlier.0)
    }
}

impl FromStr for Lsn {
    type Err = anyhow::Error;

    /// Parses PostgreSQL's text form, `16/B374D848`. Errors on anything else.
    fn from_str(s: &str) -> anyhow::Result<Lsn> {
        let (hi, lo) = s.split_once('/').with_context(|| format!("{s:?} is not an LSN"))?;
        let part = |p: &str| u32::from_str_radix(p, 16).with_context(|| format!("{s:?} is not an LSN"));
        Ok(Lsn((u64::from(part(hi)?) << 32) | u64::from(part(lo)?)))
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// One PostgreSQL 15 cluster of a [`PgPair`]: a Debian cluster listening on
/// `127.0.0.1:{port}` with trust authentication for `postgres` (connections and
/// replication).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cluster {
    /// The Debian cluster name (`pg_lsclusters`' second column).
    pub name: String,
    /// The TCP port on 127.0.0.1 (and of the Unix socket in `/var/run/postgresql`).
    pub port: u16,
    /// The major version, [`PG_VERSION`].
    pub version: u32,
}

impl Cluster {
    fn new(name: String, port: u16) -> Cluster {
        Cluster { name, port, version: PG_VERSION }
    }

    /// `postgres://postgres@127.0.0.1:{port}/{db}`.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// Connection options for database `db` as `postgres` over loopback TCP, without TLS.
    pub fn connect_options(&self, db: &str) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username("postgres")
            .database(db)
            .ssl_mode(PgSslMode::Disable)
            .application_name("boxoffice-drills-pgcluster")
    }

    /// One connection to database `db`. Errors when the server refuses it or does not
    /// answer within 10 s.
    pub async fn connect(&self, db: &str) -> anyhow::Result<PgConnection> {
        tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(&self.connect_options(db)))
            .await
            .map_err(|_| anyhow::anyhow!("connecting to {} timed out", self.name))?
            .with_context(|| format!("connecting to cluster {} on port {}", self.name, self.port))
    }

    /// The data directory, `/var/lib/postgresql/15/NAME`.
    pub fn data_dir(&self) -> PathBuf {
        data_dir(&self.name)
    }

    /// The server's log file, `/var/log/postgresql/postgresql-15-NAME.log`.
    pub fn log_file(&self) -> PathBuf {
        log_file(&self.name)
    }

    /// Stops the server at once (`pg_ctlcluster 15 NAME stop -m immediate`): every process
    /// exits without a checkpoint, as if the region failed; the next start runs crash
    /// recovery. Errors when the server is not running or the command fails.
    pub async fn stop_immediate(&self) -> anyhow::Result<()> {
        run(pg_ctlcluster(&self.name, &["stop", "-m", "immediate"]), "pg_ctlcluster stop").await?;
        Ok(())
    }

    /// Starts the server and waits until it accepts connections (read-only ones for a
    /// standby), at most 60 s: `pg_ctl start -w` as the cluster's owner with the cluster's
    /// configuration and log file. Errors when it does not start (the log's tail is in the
    /// error).
    pub async fn start(&self) -> anyhow::Result<()> {
        let owner = owner_of(&self.data_dir())?;
        let conf = conf_dir(&self.name).join("postgresql.conf");
        let mut cmd = Command::new(bin("pg_ctl"));
        cmd.arg("start")
            .arg("-D")
            .arg(self.data_dir())
            .arg("-l")
            .arg(self.log_file())
            .args(["-s", "-w", "-t", START_TIMEOUT_S, "-o"])
            .arg(format!("-c config_file={}", conf.display()));
        as_owner(&mut cmd, owner);
        only_stdio(&mut cmd);
        cmd.env_clear().env("PATH", "/usr/bin:/bin");
        if let Err(e) = run(cmd, "pg_ctl start").await {
            bail!("starting cluster {}: {e:#}\nlog tail:\n{}", self.name, self.log_tail(20));
        }
        Ok(())
    }

    /// `pg_is_in_recovery()`: true on a standby (until promoted). Errors when the server
    /// cannot be reached.
    pub async fn is_in_recovery(&self) -> anyhow::Result<bool> {
        let mut c = self.connect("postgres").await?;
        Ok(sqlx::query_scalar("SELECT pg_is_in_recovery()").fetch_one(&mut c).await?)
    }

    /// Promotes a standby: `SELECT pg_promote(true, 60)`, which returns once the server
    /// accepts writes (at most 60 s). Returns how long the call took. Errors when the server is
    /// not a standby, cannot be reached, or the promotion did not complete within 60 s.
    pub async fn promote(&self) -> anyhow::Result<Duration> {
        let mut c = self.connect("postgres").await?;
        let t = Instant::now();
        let done: bool = sqlx::query_scalar("SELECT pg_promote(true, 60)")
            .fetch_one(&mut c)
            .await
            .with_context(|| format!("promoting {}", self.name))?;
        ensure!(done, "{} was not promoted within 60 s", self.name);
        Ok(t.elapsed())
    }

    /// `pg_current_wal_lsn()`: where the server is writing WAL. Errors on a standby or when
    /// the server cannot be reached.
    pub async fn current_wal_lsn(&self) -> anyhow::Result<Lsn> {
        let mut c = self.connect("postgres").await?;
        let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text").fetch_one(&mut c).await?;
        lsn.parse()
    }

    /// `pg_last_wal_replay_lsn()`: the last WAL position a standby replayed (kept after a
    /// promotion); `None` on a server that never ran recovery from a primary. Errors when the
    /// server cannot be reached.
    pub async fn last_replay_lsn(&self) -> anyhow::Result<Option<Lsn>> {
        let mut c = self.connect("postgres").await?;
        let lsn: Option<String> =
            sqlx::query_scalar("SELECT pg_last_wal_replay_lsn()::text").fetch_one(&mut c).await?;
        lsn.map(|l| l.parse()).transpose()
    }

    /// `pg_wal_lsn_diff(a, b)` computed by this server: the bytes of WAL from `b` to `a`
    /// (negative when `b` is later). Errors when the server cannot be reached.
    pub async fn wal_lsn_diff(&self, a: Lsn, b: Lsn) -> anyhow::Result<i64> {
        let mut c = self.connect("postgres").await?;
        Ok(sqlx::query_scalar("SELECT pg_wal_lsn_diff($1::text::pg_lsn, $2::text::pg_lsn)::int8")
            .bind(a.to_string())
            .bind(b.to_string())
            .fetch_one(&mut c)
            .await?)
    }

    /// The last `lines` lines of the server's log (empty when it cannot be read).
    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(self.log_file()).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

/// Replication lag of a [`PgPair`], as the primary sees it, plus the replica's clock.
#[derive(Debug, Clone, PartialEq)]
pub struct Lag {
    /// The primary's `pg_current_wal_lsn()`.
    pub primary_lsn: Lsn,
    /// The replica's position the lag is measured from (see [`Lag::source`]).
    pub replica_lsn: Lsn,
    /// Where [`Lag::replica_lsn`] comes from.
    pub source: LagSource,
    /// WAL bytes the replica has not replayed: `pg_wal_lsn_diff(primary_lsn, replica_lsn)`
    /// on the primary, at least 0.
    pub bytes: u64,
    /// From the replica, seconds: `now() - pg_last_xact_replay_timestamp()`, the age of the
    /// last transaction it replayed; `None` before it replayed any or when it cannot be
    /// reached. It measures lag only while the primary keeps committing (on an idle primary
    /// it grows with nothing to replay).
    pub seconds: Option<f64>,
}

/// Where the replica's position of a [`Lag`] comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LagSource {
    /// `replay_lsn` of the replica's row in `pg_stat_replication`: it is connected. (Until
    /// its first report after connecting, a fraction of a second, the row has no
    /// `replay_lsn` and the slot's position is used.)
    Connected {
        /// The walsender's state is `streaming` (not `startup` or `catchup`).
        streaming: bool,
    },
    /// The replica is disconnected: the slot's `restart_lsn`, the last position the replica
    /// confirmed as flushed before it went (it reports every second and after each write, and
    /// replays what it flushes at once, so this is its replay position at the cut or close
    /// behind it; the lag may be understated by that much, never overstated).
    Slot,
}

/// The WAL positions of both clusters at one moment (for the report at the cut).
#[derive(Debug, Clone, PartialEq)]
pub struct WalPositions {
    /// The primary's `pg_current_wal_lsn()`.
    pub primary_current: Lsn,
    /// The replica's `pg_last_wal_replay_lsn()` (`None` when it never replayed, see
    /// [`Cluster::last_replay_lsn`]).
    pub replica_replay: Option<Lsn>,
    /// `pg_wal_lsn_diff(primary_current, replica_replay)` computed by the primary, bytes.
    pub bytes: Option<i64>,
}

/// A primary and its asynchronous streaming replica, replicating through a relay the pair
/// owns. See the [module](self) for everything it creates; [`PgPair::remove`] removes it.
#[derive(Debug)]
pub struct PgPair {
    /// The primary: writable, a physical slot for the replica, WAL sent through the relay.
    pub primary: Cluster,
    /// The replica: a hot standby streaming from the relay, readable while in recovery.
    pub replica: Cluster,
    /// The replica's slot on the primary.
    slot: String,
    relay: Arc<KillSwitch>,
    /// Removes both clusters when dropped, unless [`PgPair::remove`] did.
    cleanup: Cleanup,
}

impl PgPair {
    /// Creates and starts the pair: `{prefix}_{pid}_{n}_p` on a free port with
    /// [`SETTINGS`] and trust authentication on loopback (replication included); the relay in
    /// front of it; then `{prefix}_{pid}_{n}_r` from `pg_basebackup -R` through the relay
    /// (creating the slot), so its `primary_conninfo` names the relay's port; starts the
    /// replica and waits until the primary's `pg_stat_replication` shows it streaming and
    /// reporting its position (at most 60 s). Drops clusters of `prefix` left behind by
    /// processes no longer alive first.
    ///
    /// `prefix` is 1–32 characters of `a-z`, `0-9` and `_`, starting with a letter. Errors
    /// on an invalid prefix, when a tool fails (its output is in the error) or the replica
    /// does not stream in time (the replica's log tail is in the error); no cluster is left
    /// behind then, nor when the returned future is dropped before it completes.
    pub async fn create(prefix: &str) -> anyhow::Result<PgPair> {
        ensure!(
            (1..=32).contains(&prefix.len())
                && prefix.starts_with(|c: char| c.is_ascii_lowercase())
                && prefix.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
            "invalid cluster prefix {prefix:?}: 1-32 of a-z, 0-9 and _, starting with a letter"
        );
        let stale = prefix.to_owned();
        tokio::task::spawn_blocking(move || sweep_stale(&stale)).await??;

        let base = format!("{prefix}_{}_{}", std::process::id(), PAIRS.fetch_add(1, Ordering::Relaxed));
        let mut cleanup = Cleanup { names: Vec::new(), relay: None };
        let [p_port, r_port] = free_ports().await?;
        let primary = Cluster::new(format!("{base}_p"), p_port);
        let replica = Cluster::new(format!("{base}_r"), r_port);
        let slot = replica.name.clone();

        cleanup.names.push(primary.name.clone());
        let mut create = pg_tool("pg_createcluster");
        create
            .args([&PG_VERSION.to_string(), &primary.name, "-p", &p_port.to_string(), "-d"])
            .arg(primary.data_dir())
            .args(["--start-conf=manual", "--locale=C.UTF-8", "--"])
            // initdb: trust on loopback and the socket (replication included), no fsync of
            // the fresh files (the first checkpoint writes what matters).
            .args(["--auth-local=trust", "--auth-host=trust", "--no-sync"]);
        run(create, "pg_createcluster (primary)").await?;
        let mut auto = std::fs::OpenOptions::new()
            .append(true)
            .open(primary.data_dir().join("postgresql.auto.conf"))
            .context("opening the primary's postgresql.auto.conf")?;
        let settings: String = SETTINGS.iter().map(|(k, v)| format!("{k} = {v}\n")).collect();
        std::io::Write::write_all(&mut auto, format!("# boxoffice-drills pgcluster\n{settings}").as_bytes())?;
        drop(auto);
        primary.start().await?;

        let relay = KillSwitch::start(SocketAddr::from(([127, 0, 0, 1], p_port))).await?;
        cleanup.relay = Some(relay.clone());

        cleanup.names.push(replica.name.clone());
        let owner = owner_of(&primary.data_dir())?;
        let r_data = replica.data_dir();
        std::fs::create_dir(&r_data).with_context(|| format!("creating {}", r_data.display()))?;
        std::fs::set_permissions(&r_data, std::fs::Permissions::from_mode(0o700))?;
        std::os::unix::fs::chown(&r_data, Some(owner.0), Some(owner.1))?;
        let mut backup = Command::new(bin("pg_basebackup"));
        backup
            .arg("-D")
            .arg(&r_data)
            .args(["-h", "127.0.0.1", "-p", &relay.addr().port().to_string(), "-U", "postgres"])
            .args(["-R", "-C", "-S", &slot, "-X", "stream", "-c", "fast", "--no-sync", "--no-manifest"]);
        as_owner(&mut backup, owner);
        run(backup, "pg_basebackup").await?;
        // `pg_createcluster` adopts an existing data directory that holds its configuration
        // files; Debian's live in /etc, so the primary's are not in the backup.
        let p_conf = conf_dir(&primary.name);
        for f in ["pg_hba.conf", "pg_ident.conf"] {
            std::fs::copy(p_conf.join(f), r_data.join(f)).with_context(|| format!("copying {f}"))?;
        }
        std::fs::write(
            r_data.join("postgresql.conf"),
            format!("cluster_name = '{PG_VERSION}/{}'\n", replica.name),
        )?;
        for f in ["pg_hba.conf", "pg_ident.conf", "postgresql.conf"] {
            std::os::unix::fs::chown(r_data.join(f), Some(owner.0), Some(owner.1))?;
        }
        let mut adopt = pg_tool("pg_createcluster");
        adopt
            .args([&PG_VERSION.to_string(), &replica.name, "-p", &r_port.to_string(), "-d"])
            .arg(&r_data)
            .arg("--start-conf=manual");
        run(adopt, "pg_createcluster (replica)").await?;
        replica.start().await?;

        let pair = PgPair { primary, replica, slot, relay, cleanup };
        if let Err(e) = pair.wait_streaming(STREAMING_TIMEOUT).await {
            bail!("{e:#}\nreplica log tail:\n{}", pair.replica.log_tail(20));
        }
        Ok(pair)
    }

    /// The relay's address (what the replica's `primary_conninfo` names).
    pub fn relay_addr(&self) -> SocketAddr {
        self.relay.addr()
    }

    /// The replica's physical replication slot on the primary.
    pub fn slot(&self) -> &str {
        &self.slot
    }

    /// Cuts replication: the relay resets its live connections (the replica's walreceiver,
    /// and the primary's walsender on its next read or write) and resets every new one until
    /// [`PgPair::restore_replication`]. Both servers stay up and reachable directly; the
    /// primary keeps accepting writes and its slot keeps the WAL the replica misses; the
    /// replica stays a readable standby, retrying every second. Returns how many relay
    /// connections were live (1 while streaming).
    pub fn cut_replication(&self) -> u64 {
        self.relay.trip()
    }

    /// Lets the relay forward again: the replica reconnects within about a second
    /// (`wal_retrieve_retry_interval`) and catches up from its slot; see
    /// [`PgPair::wait_streaming`].
    pub fn restore_replication(&self) {
        self.relay.restore();
    }

    /// Whether replication is cut at the relay.
    pub fn is_cut(&self) -> bool {
        self.relay.is_tripped()
    }

    /// Waits until the primary's `pg_stat_replication` shows the replica (on its slot) in
    /// state `streaming` with its replay position reported, polling every 50 ms for at most
    /// `timeout`; returns how long it took. Errors at the timeout or when the primary cannot
    /// be reached.
    pub async fn wait_streaming(&self, timeout: Duration) -> anyhow::Result<Duration> {
        let t = Instant::now();
        let mut c = self.primary.connect("postgres").await?;
        loop {
            let state: Option<String> = sqlx::query_scalar(
                "SELECT r.state || CASE WHEN r.replay_lsn IS NULL THEN ' (no position reported)' ELSE '' END
                 FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
                 WHERE s.slot_name = $1",
            )
            .bind(&self.slot)
            .fetch_optional(&mut c)
            .await?;
            if state.as_deref() == Some("streaming") {
                return Ok(t.elapsed());
            }
            ensure!(
                t.elapsed() < timeout,
                "{} was not streaming from {} after {timeout:?} (walsender state: {state:?})",
                self.replica.name,
                self.primary.name
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Replication lag as the primary sees it: the bytes from the replica's `replay_lsn` in
    /// `pg_stat_replication` to `pg_current_wal_lsn()`, or from the slot's `restart_lsn`
    /// (its last confirmed position) while the replica is disconnected; and, from the
    /// replica, the seconds since the last transaction it replayed (see [`Lag`]). Errors
    /// when the primary cannot be reached, is in recovery, or lost the slot.
    pub async fn lag(&self) -> anyhow::Result<Lag> {
        let mut c = self.primary.connect("postgres").await?;
        // Current LSN, connected, walsender state, replica LSN, bytes behind.
        type Row = (String, bool, Option<String>, Option<String>, Option<i64>);
        let row: Option<Row> = sqlx::query_as(
            "SELECT cur.lsn::text, r.pid IS NOT NULL, r.state, coalesce(r.replay_lsn, s.restart_lsn)::text,
                    pg_wal_lsn_diff(cur.lsn, coalesce(r.replay_lsn, s.restart_lsn))::int8
             FROM (SELECT pg_current_wal_lsn() AS lsn) cur
             CROSS JOIN pg_replication_slots s
             LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
             WHERE s.slot_name = $1",
        )
        .bind(&self.slot)
        .fetch_optional(&mut c)
        .await?;
        let (current, connected, state, replica_lsn, bytes) =
            row.with_context(|| format!("slot {} is gone from {}", self.slot, self.primary.name))?;
        let replica_lsn = replica_lsn.with_context(|| format!("slot {} has no position", self.slot))?;
        let source = match connected {
            true => LagSource::Connected { streaming: state.as_deref() == Some("streaming") },
            false => LagSource::Slot,
        };
        let seconds = self.replica_replay_age().await.ok().flatten();
        Ok(Lag {
            primary_lsn: current.parse()?,
            replica_lsn: replica_lsn.parse()?,
            source,
            bytes: bytes.unwrap_or(0).max(0) as u64,
            seconds,
        })
    }

    /// `now() - pg_last_xact_replay_timestamp()` on the replica, seconds.
    async fn replica_replay_age(&self) -> anyhow::Result<Option<f64>> {
        let mut c = self.replica.connect("postgres").await?;
        Ok(sqlx::query_scalar("SELECT EXTRACT(EPOCH FROM now() - pg_last_xact_replay_timestamp())::float8")
            .fetch_one(&mut c)
            .await?)
    }

    /// The report at the cut: the primary's `pg_current_wal_lsn()`, the replica's
    /// `pg_last_wal_replay_lsn()` (read from the replica itself, over its own port) and the
    /// bytes between them by the primary's `pg_wal_lsn_diff`. Errors when either server
    /// cannot be reached.
    pub async fn wal_positions(&self) -> anyhow::Result<WalPositions> {
        let primary_current = self.primary.current_wal_lsn().await?;
        let replica_replay = self.replica.last_replay_lsn().await?;
        let bytes = match replica_replay {
            Some(r) => Some(self.primary.wal_lsn_diff(primary_current, r).await?),
            None => None,
        };
        Ok(WalPositions { primary_current, replica_replay, bytes })
    }

    /// Stops the relay, then both servers at once (`pg_ctlcluster … stop -m immediate`) and
    /// drops both clusters (`pg_dropcluster --stop`: data, configuration, log), the replica
    /// first. Idempotent: a cluster already gone is no error. Errors when a tool fails; the
    /// drop of the pair then tries again.
    pub async fn remove(mut self) -> anyhow::Result<()> {
        self.relay.stop();
        let names = self.cleanup.names.clone();
        tokio::task::spawn_blocking(move || remove_all(&names)).await??;
        self.cleanup.names.clear();
        Ok(())
    }
}

/// What an unfinished [`PgPair::create`] or a dropped [`PgPair`] removes, blocking.
#[derive(Debug)]
struct Cleanup {
    /// Clusters in creation order.
    names: Vec<String>,
    relay: Option<Arc<KillSwitch>>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(r) = &self.relay {
            r.stop();
        }
        if !self.names.is_empty() {
            if let Err(e) = remove_all(&self.names) {
                eprintln!("warning: removing PostgreSQL clusters {}: {e:#}", self.names.join(", "));
            }
        }
    }
}

/// Removes `names` in reverse creation order; tries each, reports every failure.
fn remove_all(names: &[String]) -> anyhow::Result<()> {
    let errors: Vec<String> =
        names.iter().rev().filter_map(|n| remove_cluster(n).err().map(|e| format!("{n}: {e:#}"))).collect();
    ensure!(errors.is_empty(), "{}", errors.join("; "));
    Ok(())
}

/// Stops cluster `name` at once and drops it; also removes what a half-made cluster left
/// (a data directory, configuration directory or log that `pg_dropcluster` does not know or
/// refuses, while no server runs on that data directory). Nothing to do is no error.
fn remove_cluster(name: &str) -> anyhow::Result<()> {
    let mut tries = 0;
    while conf_dir(name).join("postgresql.conf").exists() {
        // Immediate: a fast shutdown can wait for a walsender whose peer is gone.
        let _ = run_blocking(pg_ctlcluster(name, &["stop", "-m", "immediate"]), "pg_ctlcluster stop");
        let mut drop = pg_tool("pg_dropcluster");
        drop.args([&PG_VERSION.to_string(), name, "--stop"]);
        match run_blocking(drop, "pg_dropcluster") {
            Ok(_) => break,
            // No server on it: a cluster whose creation was interrupted (its configuration
            // may lack even the port); removed by hand below.
            Err(_) if !data_dir(name).join("postmaster.pid").exists() => break,
            // A server interrupted while starting leaves a half-written pid file for a moment.
            Err(_) if tries < 10 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(e),
        }
    }
    for dir in [data_dir(name), conf_dir(name)] {
        remove_dir(&dir)?;
    }
    for file in [log_file(name), PathBuf::from(format!("/var/run/postgresql/{PG_VERSION}-{name}.pid"))] {
        match std::fs::remove_file(&file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {}", file.display()))
            }
            _ => {}
        }
    }
    Ok(())
}

/// Removes `dir` and everything in it; retries for up to a second while it is not empty (a
/// killed tool may still be finishing a write).
fn remove_dir(dir: &Path) -> anyhow::Result<()> {
    let mut tries = 0;
    loop {
        match std::fs::remove_dir_all(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(_) if tries < 20 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(e).with_context(|| format!("removing {}", dir.display())),
        }
    }
}

/// Drops the clusters named `{prefix}_{pid}_{n}_{p|r}` whose process is no longer alive
/// (left by a killed drill or test).
fn sweep_stale(prefix: &str) -> anyhow::Result<()> {
    let mut names = std::collections::BTreeSet::new();
    for dir in [
        PathBuf::from(format!("/etc/postgresql/{PG_VERSION}")),
        PathBuf::from(format!("/var/lib/postgresql/{PG_VERSION}")),
    ] {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for e in entries.flatten() {
            if let Some(n) = e.file_name().to_str() {
                names.insert(n.to_owned());
            }
        }
    }
    for name in names {
        let Some(pid) = stale_pid(prefix, &name) else { continue };
        if pid != std::process::id() && !alive(pid) {
            eprintln!("pgcluster: dropping cluster {name}, left by process {pid}");
            remove_cluster(&name)?;
        }
    }
    Ok(())
}

/// Whether process `pid` exists and is not a zombie (killed, not yet reaped).
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // `pid (comm) S …`: the state follows the last parenthesis.
        Ok(stat) => stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')),
        Err(_) => false,
    }
}

/// The process id in a name of this prefix's pattern.
fn stale_pid(prefix: &str, name: &str) -> Option<u32> {
    let rest = name.strip_prefix(prefix)?.strip_prefix('_')?;
    let parts: Vec<&str> = rest.split('_').collect();
    match parts[..] {
        [pid, n, "p" | "r"] if n.parse::<u32>().is_ok() => pid.parse().ok(),
        _ => None,
    }
}

/// Two distinct free loopback ports, none of them configured for another cluster (bound at
/// once, then released: another process could take one in between, rare on loopback).
async fn free_ports() -> anyhow::Result<[u16; 2]> {
    let mut ls = pg_tool("pg_lsclusters");
    ls.arg("-h");
    let listed = run(ls, "pg_lsclusters").await?;
    let taken: Vec<u16> =
        listed.lines().filter_map(|l| l.split_whitespace().nth(2).and_then(|p| p.parse().ok())).collect();
    let mut held = Vec::new();
    let mut ports = Vec::new();
    while ports.len() < 2 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
        let port = l.local_addr()?.port();
        if !taken.contains(&port) && !Path::new(&format!("/var/run/postgresql/.s.PGSQL.{port}")).exists() {
            ports.push(port);
        }
        held.push(l);
    }
    Ok([ports[0], ports[1]])
}

fn data_dir(name: &str) -> PathBuf {
    PathBuf::from(format!("/var/lib/postgresql/{PG_VERSION}/{name}"))
}

fn conf_dir(name: &str) -> PathBuf {
    PathBuf::from(format!("/etc/postgresql/{PG_VERSION}/{name}"))
}

fn log_file(name: &str) -> PathBuf {
    PathBuf::from(format!("/var/log/postgresql/postgresql-{PG_VERSION}-{name}.log"))
}

/// A program of the version's own directory (`pg_ctl`, `pg_basebackup`).
fn bin(program: &str) -> PathBuf {
    PathBuf::from(format!("/usr/lib/postgresql/{PG_VERSION}/bin/{program}"))
}

/// A postgresql-common tool (`pg_createcluster`, `pg_ctlcluster`, …), run as ourselves.
fn pg_tool(program: &str) -> Command {
    Command::new(program)
}

fn pg_ctlcluster(name: &str, args: &[&str]) -> Command {
    let mut c = pg_tool("pg_ctlcluster");
    c.args([&PG_VERSION.to_string(), name]).args(args);
    c
}

/// Owner (uid, gid) of `path`.
fn owner_of(path: &Path) -> anyhow::Result<(u32, u32)> {
    let m = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    Ok((m.uid(), m.gid()))
}

/// Runs `cmd` as `owner` unless we already are that user (the server programs refuse root).
fn as_owner(cmd: &mut Command, (uid, gid): (u32, u32)) {
    let me = std::fs::metadata("/proc/self").map(|m| m.uid()).ok();
    if me != Some(uid) {
        cmd.uid(uid).gid(gid);
    }
    // The owner may not be allowed into our working directory.
    cmd.current_dir("/");
}

/// The server inherits nothing but stdio (which `pg_ctl -l` points at the log): every other
/// descriptor this process was given (a test runner's, a lock file) is marked close-on-exec,
/// so the long-lived postmaster does not hold it.
fn only_stdio(cmd: &mut Command) {
    crate::chaos::only_stdio(cmd, false);
}

/// Runs `cmd` to completion in a process group of its own; its stdout, or an error with its
/// status and output. When the future is dropped first, the whole group is killed (the
/// tools' own children too, such as `pg_createcluster`'s `initdb`), so nothing goes on
/// writing into a directory the cleanup removes.
async fn run(cmd: Command, what: &str) -> anyhow::Result<String> {
    let mut cmd = tokio::process::Command::from(cmd);
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    let child = cmd.spawn().with_context(|| format!("running {what}"))?;
    let group = child.id().map(KillGroup);
    let out = child.wait_with_output().await.with_context(|| format!("running {what}"));
    // Finished (and reaped): nothing to kill.
    std::mem::forget(group);
    checked(out?, what)
}

/// Kills the process group it names when dropped.
struct KillGroup(u32);

impl Drop for KillGroup {
    fn drop(&mut self) {
        // SAFETY: kill(2) with a negative pid signals a process group; no memory is involved.
        // The group leader is our unreaped child, so its id cannot have been reused.
        unsafe {
            libc::kill(-(self.0 as libc::pid_t), libc::SIGKILL);
        }
    }
}

/// [`run`], blocking (for drops).
fn run_blocking(mut cmd: Command, what: &str) -> anyhow::Result<String> {
    cmd.stdin(Stdio::null());
    let out = cmd.output().with_context(|| format!("running {what}"))?;
    checked(out, what)
}

fn checked(out: Output, what: &str) -> anyhow::Result<String> {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        out.status.success(),
        "{what} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim(),
        if stdout.trim().is_empty() { String::new() } else { format!("\n{}", stdout.trim()) }
    );
    Ok(stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsns_parse_print_and_subtract_like_postgresql() {
        let a: Lsn = "16/B374D848".parse().unwrap();
        assert_eq!(a.0, 0x16_B374_D848);
        assert_eq!(a.to_string(), "16/B374D848");
        assert_eq!("0/0".parse::<Lsn>().unwrap(), Lsn(0));
        let b: Lsn = "15/FFFFFFFF".parse().unwrap();
        assert_eq!(a.bytes_since(b), 0xB374_D849);
        assert_eq!(b.bytes_since(a), -0xB374_D849);
        for bad in ["", "16", "16/", "/1", "G/1", "1/100000000"] {
            assert!(bad.parse::<Lsn>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn only_this_prefixs_pattern_is_swept() {
        assert_eq!(stale_pid("drill", "drill_123_0_p"), Some(123));
        assert_eq!(stale_pid("drill", "drill_123_7_r"), Some(123));
        assert_eq!(stale_pid("drill", "drill_123_7_x"), None);
        assert_eq!(stale_pid("drill", "drill_x_7_p"), None);
        assert_eq!(stale_pid("drill", "drill_123_4_5_p"), None);
        assert_eq!(stale_pid("drill", "drillx_123_0_p"), None);
        assert_eq!(stale_pid("drill", "main"), None);
    }
}
