//! boxoffice's pure domain: identifiers, money, the order, hold and PaymentIntent state
//! machines, the hold's lifetime rules, the versioned event envelope with every purchase-saga payload, and the saga's
//! decision table.
//!
//! Nothing here performs IO. The state machines encode which transitions are legal so that
//! the saga (invariant 2: no order is confirmed without a live hold and an authorized payment),
//! the store that writes the rows and the status endpoint agree on one vocabulary; [`saga`]
//! decides what each fact does, and the workers execute it.

pub mod consumers;
pub mod events;
pub mod hold;
pub mod ids;
pub mod money;
pub mod saga;
pub mod status;

pub use events::{AuthorizationAsk, CaptureAsk, Envelope, EventKind, PurchaseEvent, RequestedCapture, Topic};
pub use hold::HoldPolicy;
pub use ids::{EventId, HoldId, OrderId, SeatId, UserId};
pub use money::Money;
pub use status::{CaptureDeadline, HoldStatus, OrderStatus, PaymentIntentStatus, PaymentUpdate};
