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
pub mod follow;
pub mod producer;
pub mod topics;

/// Headers the relay puts on every fact it publishes, from the same outbox row as the
/// envelope (`boxoffice_workers::relay`); consumers read `EVENT_TYPE` to skip facts they do
/// not act on without decoding them.
pub mod fact_headers {
    /// The fact's event id (the envelope's `event_id`).
    pub const EVENT_ID: &str = "event-id";
    /// The fact's type (the envelope's `event_type`).
    pub const EVENT_TYPE: &str = "event-type";
}

pub use config::{KafkaConfig, KafkaSecurity, RetryPolicy, SaslMechanism, SecurityProtocol};
pub use consumer::{run_consumers, Fetch, Handler, HandlerError, Members};
pub use follow::{Follower, Followers};
