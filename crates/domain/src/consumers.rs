//! The purchase topic's consumers by name: each name is the consumer's inbox key (invariant
//! 4: `(consumer, event_id)` is applied once) and the suffix of its consumer group
//! (`ticketing-{name}`). The workers take their names from here; readers of the inbox (the
//! order timeline) list them from here.

/// The saga (`boxoffice_workers::saga`).
pub const SAGA: &str = "saga";
/// The payment worker (`boxoffice_workers::payment`).
pub const PAYMENTS: &str = "payments";
/// The ticket worker (`boxoffice_workers::tickets`).
pub const TICKETS: &str = "tickets";
/// Every consumer with an inbox.
pub const ALL: [&str; 3] = [SAGA, PAYMENTS, TICKETS];
