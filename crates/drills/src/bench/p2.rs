//! P2: waiting-room attempts per second (design §3's stampede shield). Simulated clients,
//! each a new user, join an event's queue (`POST /events/{id}/queue`) and poll their ticket
//! once (`GET /queue/{ticket}`), in a closed loop at several concurrency levels, through the
//! HTTP API started in-process (the `api` role alone, rate-limit buckets off so the bench
//! measures the queue rather than the bucket's refusals). One attempt is one request (a
//! join or a poll). The same join + poll is then measured as direct library calls
//! (`Waitroom::join` / `Waitroom::status`), which shows whether HTTP or Redis bounds it.
//! Keys live under a unique Redis prefix, deleted afterwards.

use super::{BenchArgs, BenchDb};
use anyhow::Context;
use boxoffice::config::Config;
use boxoffice::runtime::{self, Role};
use boxoffice_domain::{EventId, UserId};
use boxoffice_harness::client::{BuyerClient, QueueView};
use boxoffice_harness::stats::{self, histogram, quantiles_ms};
use boxoffice_store::venue::{self, VenueSpec};
use boxoffice_waitroom::Waitroom;
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// One concurrency level of one path.
#[derive(Debug, Clone, Serialize)]
pub struct P2Level {
    /// `http` or `library`.
    pub path: String,
    /// Concurrent clients.
    pub concurrency: usize,
    /// Measured seconds.
    pub seconds: f64,
    /// Requests (joins + polls) answered successfully.
    pub attempts: u64,
    /// Failed requests (non-2xx, transport errors, Redis errors).
    pub errors: u64,
    /// The failed requests by kind: the HTTP status code (`"429"`, `"503"`, …), `"transport"`
    /// (no answer, or a body that did not arrive or parse), or `"redis"` (a library call's error).
    pub errors_by_kind: std::collections::BTreeMap<String, u64>,
    /// Successful attempts per second.
    pub attempts_per_s: f64,
    /// Latency of one attempt, ms.
    pub p50_ms: f64,
    /// 99th percentile, ms.
    pub p99_ms: f64,
    /// Largest, ms.
    pub max_ms: f64,
    /// Where the CPU went ("other" is mostly Redis).
    pub cpu: super::CpuUse,
}

/// P2's result.
#[derive(Debug, Clone, Serialize)]
pub struct P2Result {
    /// Every level of both paths.
    pub levels: Vec<P2Level>,
    /// Best HTTP level whose p99 is under 20 ms (the target's bound) and that had no failed
    /// request, else the best under the bound, else the best overall ([`best_level`]).
    pub best_http: Option<P2Level>,
    /// Best library level likewise.
    pub best_library: Option<P2Level>,
}

/// The target's latency bound on P2 attempts, ms.
pub const P2_P99_BOUND_MS: f64 = 20.0;

/// Runs P2 (a small fresh database holds the event the queue is for).
pub async fn run(cfg: &Config, args: &BenchArgs) -> anyhow::Result<P2Result> {
    let (db, pool) = BenchDb::migrated(cfg, "p2", 4).await?;
    let mut cfg = cfg.clone();
    cfg.redis_key_prefix = format!("bench{}:", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let result = run_on(&mut cfg, args, &db, &pool).await;
    if let Err(e) = delete_keys(&cfg).await {
        tracing::warn!(error = %format!("{e:#}"), "could not delete the bench's Redis keys");
    }
    pool.close().await;
    db.drop_db().await;
    result
}

async fn run_on(
    cfg: &mut Config,
    args: &BenchArgs,
    db: &BenchDb,
    pool: &sqlx::PgPool,
) -> anyhow::Result<P2Result> {
    let name = format!("Bench P2 {}", uuid::Uuid::new_v4());
    let (event, _) =
        venue::seed(pool, &name, &VenueSpec::small(1, 1, 10), chrono::Utc::now(), &cfg.purchase_cell).await?;
    cfg.http_bind = "127.0.0.1:0".into();
    cfg.rate_limit_ip_per_s = 0.0;
    cfg.rate_limit_user_per_s = 0.0;
    cfg.release_max_per_s = 0.0;
    cfg.waitroom_max_positions_per_user = 1_000;
    let shutdown = CancellationToken::new();
    let running = runtime::start(cfg, &[Role::Api], db.opts.clone(), shutdown.clone()).await?;
    let api = format!("http://{}", running.api_addr.context("api did not start")?);
    let users = Arc::new(runtime::user_tokens(cfg));
    let http =
        reqwest::Client::builder().pool_max_idle_per_host(1_024).timeout(Duration::from_secs(10)).build()?;
    let client = BuyerClient::new(http, api);
    let room = runtime::waitroom(cfg)?;
    let mut levels = Vec::new();
    let result: anyhow::Result<()> = async {
        for &c in &args.p2_concurrency {
            let l = http_level(&client, event, users.clone(), c, args.p2_seconds).await?;
            print_level(&l);
            levels.push(l);
        }
        for &c in &args.p2_concurrency {
            let l = library_level(&room, event, c, args.p2_seconds).await?;
            print_level(&l);
            levels.push(l);
        }
        Ok(())
    }
    .await;
    shutdown.cancel();
    running.join().await;
    result?;
    Ok(P2Result {
        best_http: best_level(&levels, "http"),
        best_library: best_level(&levels, "library"),
        levels,
    })
}

/// The level of `path` with the most successful attempts per second among those with p99 under
/// [`P2_P99_BOUND_MS`] and no failed request; else among those under the bound (failures and
/// all); else of all. A level where requests were refused (e.g. the API's 429s once more clients
/// than `http_max_in_flight_per_ip` share one address) is not the waiting room serving that rate.
fn best_level(levels: &[P2Level], path: &str) -> Option<P2Level> {
    let most = |it: &mut dyn Iterator<Item = &P2Level>| {
        it.max_by(|a, b| a.attempts_per_s.total_cmp(&b.attempts_per_s)).cloned()
    };
    let of_path = || levels.iter().filter(move |l| l.path == path);
    most(&mut of_path().filter(|l| l.p99_ms < P2_P99_BOUND_MS && l.errors == 0))
        .or_else(|| most(&mut of_path().filter(|l| l.p99_ms < P2_P99_BOUND_MS)))
        .or_else(|| most(&mut of_path()))
}

/// A failed request that got no answer, or whose answer's body did not arrive or parse.
const TRANSPORT: &str = "transport";
/// A library call that returned an error.
const REDIS: &str = "redis";

fn print_level(l: &P2Level) {
    eprintln!(
        "   {:<7} c={:<4} attempts/s {:>8.0}  p50 {:>6.2} ms  p99 {:>7.2} ms  errors {}",
        l.path,
        l.concurrency,
        l.attempts_per_s,
        l.p50_ms,
        l.p99_ms,
        errors_text(l)
    );
}

/// `0`, or the count with its kinds: `27579 (429: 27579)`.
pub fn errors_text(l: &P2Level) -> String {
    if l.errors == 0 {
        return "0".into();
    }
    let kinds: Vec<String> = l.errors_by_kind.iter().map(|(k, n)| format!("{k}: {n}")).collect();
    format!("{} ({})", l.errors, kinds.join(", "))
}

#[derive(Default)]
struct Counts {
    ok: AtomicU64,
    errors: Mutex<std::collections::BTreeMap<String, u64>>,
}

/// Runs `c` closed-loop clients for `secs`; each iteration calls `attempt` which returns the
/// latencies of its successful requests and the kind of the request that failed, if one did
/// (an attempt stops at its first failure).
async fn closed_loop<F, Fut>(c: usize, secs: u64, attempt: F) -> Measured
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = (Vec<Duration>, Option<String>)> + Send + 'static,
{
    let attempt = Arc::new(attempt);
    let cpu_before = super::CpuSnap::now();
    let counts = Arc::new(Counts::default());
    let hist = Arc::new(Mutex::new(histogram()));
    let started = Instant::now();
    let until = started + Duration::from_secs(secs);
    let tasks: Vec<_> = (0..c)
        .map(|_| {
            let (attempt, counts, hist) = (attempt.clone(), counts.clone(), hist.clone());
            tokio::spawn(async move {
                let mut local = histogram();
                while Instant::now() < until {
                    let (lat, failed) = attempt().await;
                    for d in &lat {
                        stats::record(&mut local, *d);
                    }
                    counts.ok.fetch_add(lat.len() as u64, Ordering::Relaxed);
                    if let Some(kind) = failed {
                        *counts.errors.lock().expect("error counts lock").entry(kind).or_default() += 1;
                        if lat.is_empty() {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                }
                let _ = hist.lock().expect("histogram lock").add(&local);
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
    let secs = started.elapsed().as_secs_f64();
    let cpu = cpu_before.until(&super::CpuSnap::now());
    let h = hist.lock().expect("histogram lock").clone();
    let errors = std::mem::take(&mut *counts.errors.lock().expect("error counts lock"));
    Measured { secs, ok: counts.ok.load(Ordering::Relaxed), errors, h, cpu }
}

/// What one closed-loop run measured.
struct Measured {
    secs: f64,
    ok: u64,
    errors: std::collections::BTreeMap<String, u64>,
    h: hdrhistogram::Histogram<u64>,
    cpu: super::CpuUse,
}

fn level(path: &str, c: usize, Measured { secs, ok, errors, h, cpu }: Measured) -> P2Level {
    let (p50_ms, p99_ms, max_ms) = quantiles_ms(&h);
    P2Level {
        path: path.into(),
        concurrency: c,
        seconds: secs,
        attempts: ok,
        errors: errors.values().sum(),
        errors_by_kind: errors,
        attempts_per_s: ok as f64 / secs,
        p50_ms,
        p99_ms,
        max_ms,
        cpu,
    }
}

async fn http_level(
    client: &BuyerClient,
    event: EventId,
    users: Arc<boxoffice_admission::UserTokens>,
    c: usize,
    secs: u64,
) -> anyhow::Result<P2Level> {
    let client = client.clone();
    let m = closed_loop(c, secs, move || {
        let (client, users) = (client.clone(), users.clone());
        async move {
            let bearer = format!("Bearer {}", users.issue(UserId(uuid::Uuid::new_v4()), 3_600));
            let mut lat = Vec::with_capacity(2);
            let t = Instant::now();
            let joined = match client.join_queue(&bearer, event.0).send().await {
                Ok(r) if r.status().is_success() => {
                    r.json::<QueueView>().await.map_err(|_| TRANSPORT.to_owned())
                }
                Ok(r) => Err(r.status().as_u16().to_string()),
                Err(_) => Err(TRANSPORT.to_owned()),
            };
            let joined = match joined {
                Ok(joined) => joined,
                Err(kind) => return (lat, Some(kind)),
            };
            lat.push(t.elapsed());
            let t = Instant::now();
            match client.poll_queue(&bearer, joined.ticket).send().await {
                Ok(r) if r.status().is_success() => {
                    if r.bytes().await.is_err() {
                        return (lat, Some(TRANSPORT.to_owned()));
                    }
                    lat.push(t.elapsed());
                    (lat, None)
                }
                Ok(r) => (lat, Some(r.status().as_u16().to_string())),
                Err(_) => (lat, Some(TRANSPORT.to_owned())),
            }
        }
    })
    .await;
    Ok(level("http", c, m))
}

async fn library_level(room: &Waitroom, event: EventId, c: usize, secs: u64) -> anyhow::Result<P2Level> {
    let room = room.clone();
    let m = closed_loop(c, secs, move || {
        let room = room.clone();
        async move {
            let user = UserId(uuid::Uuid::new_v4());
            let mut lat = Vec::with_capacity(2);
            let t = Instant::now();
            let Ok(ticket) = room.join(event, user).await else { return (lat, Some(REDIS.to_owned())) };
            lat.push(t.elapsed());
            let t = Instant::now();
            match room.status(ticket.ticket, user).await {
                Ok(_) => {
                    lat.push(t.elapsed());
                    (lat, None)
                }
                Err(_) => (lat, Some(REDIS.to_owned())),
            }
        }
    })
    .await;
    Ok(level("library", c, m))
}

/// Deletes every key under the bench's prefix (`cfg.redis_key_prefix`).
pub(crate) async fn delete_keys(cfg: &Config) -> anyhow::Result<()> {
    use secrecy::ExposeSecret;
    let client = redis::Client::open(cfg.redis_url.expose_secret())?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let pattern = format!("{}*", cfg.redis_key_prefix);
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(5_000)
            .query_async(&mut conn)
            .await?;
        if !keys.is_empty() {
            let _: () = redis::cmd("UNLINK").arg(&keys).query_async(&mut conn).await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn level(path: &str, concurrency: usize, attempts_per_s: f64, p99_ms: f64, errors: u64) -> P2Level {
        P2Level {
            path: path.into(),
            concurrency,
            seconds: 8.0,
            attempts: (attempts_per_s * 8.0) as u64,
            errors,
            attempts_per_s,
            p50_ms: p99_ms / 4.0,
            p99_ms,
            max_ms: p99_ms * 2.0,
            errors_by_kind: if errors == 0 {
                Default::default()
            } else {
                [("429".to_owned(), errors)].into()
            },
            cpu: super::super::CpuUse::default(),
        }
    }

    #[test]
    fn the_best_level_refused_no_request_and_kept_the_latency_bound() {
        let levels = vec![
            level("http", 4, 10_000.0, 1.3, 0),
            level("http", 16, 14_000.0, 2.7, 0),
            level("http", 64, 15_000.0, 6.0, 27_000),
            level("http", 128, 16_000.0, 25.0, 0),
            level("library", 64, 40_000.0, 5.0, 0),
        ];
        assert_eq!(best_level(&levels, "http").map(|l| l.concurrency), Some(16));
        assert_eq!(best_level(&levels, "library").map(|l| l.concurrency), Some(64));
        // Every level under the bound refused requests: the best of them, failures and all.
        let failing = vec![
            level("http", 16, 9_000.0, 2.0, 5),
            level("http", 64, 12_000.0, 6.0, 9),
            level("http", 128, 20_000.0, 30.0, 0),
        ];
        assert_eq!(best_level(&failing, "http").map(|l| l.concurrency), Some(64));
        // None under the bound: the best overall.
        let slow = vec![level("http", 16, 9_000.0, 21.0, 0), level("http", 64, 12_000.0, 40.0, 0)];
        assert_eq!(best_level(&slow, "http").map(|l| l.concurrency), Some(64));
        assert!(best_level(&levels, "grpc").is_none());
        assert_eq!(errors_text(&levels[0]), "0");
        assert_eq!(errors_text(&levels[2]), "27000 (429: 27000)");
    }
}
