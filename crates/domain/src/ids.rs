//! Newtype identifiers. Each wraps a UUID so that an order id can never be passed where a
//! seat id is expected; all parse from their canonical hyphenated text form.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use uuid::Uuid;

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema), schema(value_type = uuid::Uuid))]
        #[serde(transparent)]
        pub struct $name(pub Uuid);

        impl $name {
            /// A fresh random (v4) identifier.
            pub fn new() -> Self {
                Self(Uuid::new_v4())
            }
            /// The wrapped UUID.
            pub fn as_uuid(&self) -> Uuid {
                self.0
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl FromStr for $name {
            type Err = uuid::Error;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Uuid::parse_str(s).map(Self)
            }
        }

        impl From<Uuid> for $name {
            fn from(u: Uuid) -> Self {
                Self(u)
            }
        }
    };
}

id_type!(
    /// A ticketed event (a concert, a match): the thing an onsale sells seats for.
    EventId
);
id_type!(
    /// One reserved seat of one event's venue.
    SeatId
);
id_type!(
    /// A buyer's order: the saga's aggregate and the Kafka message key.
    OrderId
);
id_type!(
    /// A temporary claim on 1–8 seats, owned by exactly one order.
    HoldId
);
id_type!(
    /// An authenticated buyer (the `sub` claim of the user JWT).
    UserId
);

/// Namespace for ticket ids: `ticket_id = uuid_v5(TICKET_NS, order_id ++ seat_id)`, so a
/// replayed issuance derives the same id (invariant 1: one ticket per seat, replay-safe).
pub const TICKET_NAMESPACE: Uuid = Uuid::from_u128(0x6f0e_5d1c_8b0a_4e1f_9a44_2b7c_1d3e_0a01);

/// The stable ticket id for `(order, seat)`.
pub fn ticket_id(order: OrderId, seat: SeatId) -> Uuid {
    let mut name = [0u8; 32];
    name[..16].copy_from_slice(order.0.as_bytes());
    name[16..].copy_from_slice(seat.0.as_bytes());
    Uuid::new_v5(&TICKET_NAMESPACE, &name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticket_id_is_stable_and_distinct() {
        let (o, s1, s2) = (OrderId::new(), SeatId::new(), SeatId::new());
        assert_eq!(ticket_id(o, s1), ticket_id(o, s1));
        assert_ne!(ticket_id(o, s1), ticket_id(o, s2));
    }

    #[test]
    fn ids_parse_round_trip() {
        let id = OrderId::new();
        assert_eq!(id.to_string().parse::<OrderId>().unwrap(), id);
        assert!("not-a-uuid".parse::<OrderId>().is_err());
    }
}
