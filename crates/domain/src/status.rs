//! Order and hold state machines.
//!
//! The order status stored in PostgreSQL *is* the client-visible workflow state of the design
//! (§1): `held → payment_required → (authorized) → confirming → paid → ticketed`, with the
//! failure branches `expired`, `failed`, `canceled`, `refunding → refunded`. Only the saga
//! moves an order along; [`OrderStatus::can_transition_to`] is the single list of legal moves,
//! so "no order is confirmed without a live hold and an authorized payment" (invariant 2) is
//! checked in one place.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The state of an order as stored and as shown to its owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum OrderStatus {
    /// Seats are held; the PaymentIntent is being created.
    Held,
    /// A PaymentIntent exists; the buyer must confirm it with its client secret.
    PaymentRequired,
    /// Stripe reports the PaymentIntent `requires_capture`; the saga has not confirmed yet.
    /// Derived for display from the payment row; never stored on the order.
    Authorized,
    /// The hold is confirmed and capture was requested.
    Confirming,
    /// Money was captured; tickets are being issued.
    Paid,
    /// Final: tickets exist for every held seat.
    Ticketed,
    /// Final: the hold ran out before the payment was authorized.
    Expired,
    /// Final: the payment failed (capture failed, authorization expired).
    Failed,
    /// Final: a late authorization was cancelled at the provider.
    Canceled,
    /// Money was captured for an order that cannot be fulfilled; the refund is in flight.
    Refunding,
    /// Final: the captured money was returned.
    Refunded,
}

impl OrderStatus {
    /// Every status, in workflow order.
    pub const ALL: [OrderStatus; 11] = [
        Self::Held,
        Self::PaymentRequired,
        Self::Authorized,
        Self::Confirming,
        Self::Paid,
        Self::Ticketed,
        Self::Expired,
        Self::Failed,
        Self::Canceled,
        Self::Refunding,
        Self::Refunded,
    ];

    /// The text stored in `orders.status` and shown in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Held => "held",
            Self::PaymentRequired => "payment_required",
            Self::Authorized => "authorized",
            Self::Confirming => "confirming",
            Self::Paid => "paid",
            Self::Ticketed => "ticketed",
            Self::Expired => "expired",
            Self::Failed => "failed",
            Self::Canceled => "canceled",
            Self::Refunding => "refunding",
            Self::Refunded => "refunded",
        }
    }

    /// Final states: the saga has nothing left to do for the order.
    pub fn is_final(self) -> bool {
        matches!(self, Self::Ticketed | Self::Expired | Self::Failed | Self::Canceled | Self::Refunded)
    }

    /// States in which the hold may still be live and a payment may still be authorized.
    pub fn awaits_authorization(self) -> bool {
        matches!(self, Self::Held | Self::PaymentRequired | Self::Authorized)
    }

    /// Whether the saga may move an order from `self` to `next`.
    pub fn can_transition_to(self, next: OrderStatus) -> bool {
        use OrderStatus::*;
        matches!(
            (self, next),
            (Held, PaymentRequired)
                | (Held | PaymentRequired | Authorized, Confirming)
                | (Held | PaymentRequired | Authorized, Expired)
                | (Held | PaymentRequired | Authorized, Failed)
                | (Held | PaymentRequired | Authorized | Expired | Failed, Canceled)
                | (Confirming, Paid)
                | (Confirming, Failed)
                | (Paid, Ticketed)
                | (Confirming | Paid | Expired | Failed | Canceled, Refunding)
                | (Refunding, Refunded)
        )
    }
}

impl fmt::Display for OrderStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown status string read from storage.
#[derive(Debug, thiserror::Error)]
#[error("unknown status {0:?}")]
pub struct UnknownStatus(pub String);

impl FromStr for OrderStatus {
    type Err = UnknownStatus;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|x| x.as_str() == s).ok_or_else(|| UnknownStatus(s.to_owned()))
    }
}

/// The state of a hold (`holds.status`). Only `active` and `confirmed` holds own seats; the
/// partial unique index on `hold_seats(seat_id) WHERE released_at IS NULL` enforces one owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HoldStatus {
    /// Owns its seats until `expires_at`.
    Active,
    /// Frozen by the saga after authorization; no longer expires.
    Confirmed,
    /// Timed out; its seats were released.
    Expired,
    /// Ended on purpose (tickets issued, or capture failed); its seats were released.
    Released,
}

impl HoldStatus {
    /// The text stored in `holds.status`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Active => "active",
            Self::Confirmed => "confirmed",
            Self::Expired => "expired",
            Self::Released => "released",
        }
    }
}

impl FromStr for HoldStatus {
    type Err = UnknownStatus;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "active" => Ok(Self::Active),
            "confirmed" => Ok(Self::Confirmed),
            "expired" => Ok(Self::Expired),
            "released" => Ok(Self::Released),
            _ => Err(UnknownStatus(s.to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::OrderStatus::*;
    use super::*;

    #[test]
    fn statuses_round_trip() {
        for s in OrderStatus::ALL {
            assert_eq!(s.as_str().parse::<OrderStatus>().unwrap(), s);
        }
    }

    #[test]
    fn final_states_only_leave_for_refunds() {
        for from in OrderStatus::ALL.into_iter().filter(|s| s.is_final()) {
            for to in OrderStatus::ALL {
                if from.can_transition_to(to) {
                    assert!(matches!(to, Refunding | Canceled), "{from} -> {to} must not be legal");
                }
            }
        }
    }

    #[test]
    fn nothing_is_confirmed_after_expiry() {
        assert!(!Expired.can_transition_to(Confirming));
        assert!(!Canceled.can_transition_to(Confirming));
        assert!(!Ticketed.can_transition_to(Confirming));
    }
}
