//! Kafka for boxoffice: topic provisioning, the idempotent producer used by the outbox relay,
//! the consumer runner that applies each message once (invariant 4), and an embedded
//! in-process broker for single-process demos.
//!
//! Kafka is never the seat lock: it carries durable facts between saga stages, at least once.
//! Every message is keyed by order id, so one order's events stay ordered within a
//! partition; nothing relies on ordering across orders.

pub mod config;
pub mod consumer;
pub mod dlq;
pub mod embedded;
pub mod producer;
pub mod topics;

pub use config::{KafkaConfig, KafkaSecurity, RetryPolicy, SaslMechanism, SecurityProtocol};
pub use consumer::{run_consumers, Handler, HandlerError};
