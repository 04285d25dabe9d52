//! boxoffice's pure domain: identifiers, money, the order and hold state machines and the
//! versioned event envelope with every purchase-saga payload.
//!
//! Nothing here performs IO. The state machines encode which transitions are legal so that
//! the saga (invariant 2: no order is confirmed without a live hold and an authorized payment)
//! and the status endpoint agree on one vocabulary.

pub mod events;
pub mod ids;
pub mod money;
pub mod status;

pub use events::{Envelope, PurchaseEvent, Topic};
pub use ids::{EventId, HoldId, OrderId, SeatId, UserId};
pub use money::Money;
pub use status::{HoldStatus, OrderStatus};
