//! boxoffice's integration tests: one binary, real PostgreSQL (a fresh database per test via
//! `#[sqlx::test]`), the real Kafka-protocol broker started by `scripts/test`
//! (`BOXOFFICE_TEST_KAFKA_BROKERS`), and the Stripe simulator in-process.

mod helpers;

mod audit;
mod bench;
mod chaos;
mod compensation;
mod e2e;
mod faults;
mod holds;
mod purchase;
mod release;
mod saga;
mod waitroom;
mod webhooks;
