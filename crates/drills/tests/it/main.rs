//! boxoffice's integration tests: one binary, real PostgreSQL (a fresh database per test via
//! `#[sqlx::test]`), the real Kafka-protocol broker started by `scripts/test`
//! (`BOXOFFICE_TEST_KAFKA_BROKERS`), and the Stripe simulator in-process, set up by
//! `boxoffice-harness`. The tests that run a compiled binary use `boxoffice-drills` (this
//! package's) and the product's `boxoffice` next to it (see [`helpers::product_bin`] and the
//! crate docs for why the binary lives in the drills crate).

mod helpers;

mod audit;
mod bench;
mod cells;
mod cells_drill;
mod chaos;
mod compensation;
mod consumer_batch;
mod contract;
mod dashboard;
mod e2e;
mod edge;
mod failover_drill;
mod faults;
mod follow;
mod holds;
mod lifetime;
mod limits;
mod observe;
mod pgcluster;
mod purchase;
mod region;
mod release;
mod saga;
mod secrets;
mod sweeps;
mod tracing;
mod waitroom;
mod webhooks;
