//! boxoffice's background roles. Each is a long-running task that stops cleanly on its
//! `CancellationToken` (finishing the in-flight transaction, leaving uncommitted offsets to
//! replay):
//!
//! - [`relay`]: publishes the transactional outbox to Kafka (invariant 5);
//! - [`saga`]: the orchestrator, sole owner of order transitions (invariants 2 and 6);
//! - [`payment`]: every Stripe call, each with a stable idempotency key (invariants 4 and 6);
//! - [`expiry`]: releases lapsed holds in bounded `SKIP LOCKED` batches (invariant 1);
//! - [`tickets`]: issues one ticket per held seat, replay-safe (invariant 1);
//! - [`lease`]: renews the region lease from the witness and stops writes when it lapses
//!   (design §15);
//! - [`release`]: the waiting room's adaptive release controller (design §3): admits queued
//!   buyers at a rate `R` that follows live database, outbox and broker signals.

pub mod expiry;
pub mod lease;
pub mod payment;
pub mod relay;
pub mod release;
pub mod saga;
pub mod tickets;

/// Backoff helper for worker loops: `base_ms · 2^attempt`, capped, with full jitter.
pub fn backoff(attempt: u32, base_ms: u64, cap_ms: u64) -> std::time::Duration {
    use rand::Rng;
    let ceiling = (base_ms << attempt.min(16)).min(cap_ms).max(1);
    std::time::Duration::from_millis(rand::thread_rng().gen_range(ceiling / 2..=ceiling))
}
