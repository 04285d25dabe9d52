//! The failover drill's PostgreSQL pair ([`boxoffice_drills::pgcluster`]): a replica cut off
//! from its primary lags and misses the primary's new writes; promoted, it writes; the old
//! primary, started again, writes too — nothing in PostgreSQL fences it.

use crate::helpers::eventually;
use boxoffice_drills::pgcluster::{LagSource, PgPair};
use sqlx::PgPool;
use std::time::{Duration, Instant};

async fn pool(c: &boxoffice_drills::pgcluster::Cluster) -> PgPool {
    boxoffice_store::connect(c.connect_options("postgres"), 2, 10_000).await.unwrap()
}

async fn rows(pool: &PgPool) -> Option<i64> {
    sqlx::query_scalar("SELECT count(*) FROM drill_rows").fetch_one(pool).await.ok()
}

#[tokio::test]
async fn a_cut_replica_lags_then_is_promoted_while_the_old_primary_returns_writable() {
    let started = Instant::now();
    let pair = PgPair::create("bo_pgc").await.unwrap();
    let created = started.elapsed();
    let (p_name, r_name) = (pair.primary.name.clone(), pair.replica.name.clone());
    assert!(pair.replica.is_in_recovery().await.unwrap());
    assert!(!pair.primary.is_in_recovery().await.unwrap());
    let primary = pool(&pair.primary).await;
    let replica = pool(&pair.replica).await;

    sqlx::query("CREATE TABLE drill_rows (id bigint PRIMARY KEY, at text NOT NULL)")
        .execute(&primary)
        .await
        .unwrap();
    sqlx::query("INSERT INTO drill_rows VALUES (1, 'before the cut')").execute(&primary).await.unwrap();
    let t = Instant::now();
    let r = &replica;
    eventually(Duration::from_secs(30), "the replica sees the first row", move || async move {
        rows(r).await == Some(1)
    })
    .await;
    let replicated_in = t.elapsed();

    assert_eq!(pair.cut_replication(), 1, "the replica's one connection is cut");
    let t = Instant::now();
    let p = &pair;
    eventually(Duration::from_secs(30), "the primary sees the replica gone", move || async move {
        p.lag().await.unwrap().source == LagSource::Slot
    })
    .await;
    let noticed_in = t.elapsed();
    let at_cut = pair.wal_positions().await.unwrap();
    let replayed_at_cut = at_cut.replica_replay.expect("the replica replayed");

    sqlx::query("INSERT INTO drill_rows SELECT g, 'during the cut' FROM generate_series(2, 1001) g")
        .execute(&primary)
        .await
        .unwrap();
    let lag = pair.lag().await.unwrap();
    assert_eq!(lag.source, LagSource::Slot);
    assert!(lag.bytes > 0, "{lag:?}");
    assert!(lag.primary_lsn > at_cut.primary_current, "{lag:?} {at_cut:?}");
    assert_eq!(rows(&replica).await, Some(1), "the replica misses the writes made during the cut");
    let after = pair.wal_positions().await.unwrap();
    assert_eq!(after.replica_replay, Some(replayed_at_cut), "the replica replayed nothing since the cut");
    let diff = after.bytes.unwrap();
    assert_eq!(i128::from(diff), after.primary_current.bytes_since(replayed_at_cut));
    assert!(diff >= lag.bytes as i64, "{after:?} {lag:?}");

    pair.primary.stop_immediate().await.unwrap();
    assert!(pair.primary.connect("postgres").await.is_err(), "the primary is down");
    let promoted_in = pair.replica.promote().await.unwrap();
    assert!(!pair.replica.is_in_recovery().await.unwrap());
    assert_eq!(rows(&replica).await, Some(1), "what the replica missed is lost to it");
    sqlx::query("INSERT INTO drill_rows VALUES (2, 'on the promoted replica')")
        .execute(&replica)
        .await
        .unwrap();

    let t = Instant::now();
    pair.primary.start().await.unwrap();
    let restarted_in = t.elapsed();
    assert!(!pair.primary.is_in_recovery().await.unwrap(), "the old primary is a primary still");
    let zombie = pool(&pair.primary).await;
    assert_eq!(rows(&zombie).await, Some(1001));
    sqlx::query("INSERT INTO drill_rows VALUES (1002, 'on the zombie')").execute(&zombie).await.unwrap();
    let on_zombie: String =
        sqlx::query_scalar("SELECT at FROM drill_rows WHERE id = 2").fetch_one(&zombie).await.unwrap();
    assert_eq!(on_zombie, "during the cut", "both sides accepted their own row 2");

    primary.close().await;
    replica.close().await;
    zombie.close().await;
    let t = Instant::now();
    pair.remove().await.unwrap();
    let removed_in = t.elapsed();
    let listed = std::process::Command::new("pg_lsclusters").arg("-h").output().unwrap();
    assert!(listed.status.success());
    let listed = String::from_utf8(listed.stdout).unwrap();
    for name in [&p_name, &r_name] {
        assert!(!listed.split_whitespace().any(|w| w == name), "{name} is still listed:\n{listed}");
        assert!(!std::path::Path::new(&format!("/var/lib/postgresql/15/{name}")).exists());
        assert!(!std::path::Path::new(&format!("/etc/postgresql/15/{name}")).exists());
    }
    eprintln!(
        "pgcluster: create {created:.2?}, first row replicated in {replicated_in:.2?}, cut noticed by the \
         primary in {noticed_in:.2?}, lag {} bytes at {:?} s, promote {promoted_in:.2?}, old primary \
         restarted in {restarted_in:.2?}, remove {removed_in:.2?}, whole test {:.2?}",
        lag.bytes,
        lag.seconds,
        started.elapsed()
    );
}
