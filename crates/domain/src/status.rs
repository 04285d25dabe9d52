//! The three status vocabularies of the ledger and their transition tables: orders, holds
//! and the mirrored Stripe PaymentIntent.
//!
//! The order status stored in PostgreSQL *is* the client-visible workflow state of the design
//! (§1): `held → payment_required → (authorized) → confirming → paid → ticketed`, with the
//! failure branches `expired`, `failed`, `canceled`, `refunding → refunded`.
//! [`OrderStatus::can_transition_to`], [`HoldStatus::can_transition_to`] and
//! [`PaymentIntentStatus::can_transition_to`] are the single lists of legal moves. The store's
//! transition functions are the only writers of a status column — `transition` in
//! `boxoffice_store::{orders, holds, payments}`, the expiry's set-wise `holds::expire_batch` /
//! `orders::expire_unpaid`, and the payment mirror's guarded `record_decline` /
//! `mirror_authorized` — and each refuses (or filters out) any move these tables do not list,
//! so "no order is confirmed without a live hold and an authorized payment" (invariant 2) is
//! checked where the row is written. Each enum has one text form (`as_str`, parsed back by `FromStr` /
//! `TryFrom<String>`), the one stored in its column.

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

    /// Every status the table lets reach `to` (the source filter of set-wise writes).
    pub fn sources_of(to: OrderStatus) -> Vec<OrderStatus> {
        Self::ALL.into_iter().filter(|from| from.can_transition_to(to)).collect()
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
                // The money went back at the provider (a dashboard refund): tickets are void.
                | (Ticketed, Refunded)
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

impl TryFrom<String> for OrderStatus {
    type Error = UnknownStatus;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

/// The state of a hold (`holds.status`). Only `active` and `confirmed` holds own seats; the
/// partial unique index on `hold_seats(seat_id) WHERE released_at IS NULL` enforces one owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
    /// Every status, in lifecycle order.
    pub const ALL: [HoldStatus; 4] = [Self::Active, Self::Confirmed, Self::Expired, Self::Released];

    /// The text stored in `holds.status`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Active => "active",
            Self::Confirmed => "confirmed",
            Self::Expired => "expired",
            Self::Released => "released",
        }
    }

    /// Whether a hold in this status has given its seats back (`hold_seats.released_at` set).
    pub fn releases_seats(self) -> bool {
        matches!(self, Self::Expired | Self::Released)
    }

    /// Whether a hold may move from `self` to `next`: an active hold is confirmed by the saga
    /// (a live hold and an authorized payment, invariant 2) or expires; a confirmed hold never
    /// expires and is released once tickets own its seats or the payment failed.
    pub fn can_transition_to(self, next: HoldStatus) -> bool {
        use HoldStatus::*;
        matches!((self, next), (Active, Confirmed) | (Active, Expired) | (Confirmed, Released))
    }

    /// Every status the table lets reach `to`.
    pub fn sources_of(to: HoldStatus) -> Vec<HoldStatus> {
        Self::ALL.into_iter().filter(|from| from.can_transition_to(to)).collect()
    }
}

impl fmt::Display for HoldStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for HoldStatus {
    type Err = UnknownStatus;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|x| x.as_str() == s).ok_or_else(|| UnknownStatus(s.to_owned()))
    }
}

impl TryFrom<String> for HoldStatus {
    type Error = UnknownStatus;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

/// A Stripe PaymentIntent's status (<https://docs.stripe.com/payments/paymentintents/lifecycle>),
/// as the provider reports it and as `payments.status` mirrors it. A status this build does
/// not know is kept as [`PaymentIntentStatus::Unknown`] rather than refused: Stripe adds
/// values, and the mirror must still round-trip them.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum PaymentIntentStatus {
    /// `requires_payment_method`: created, or the last confirmation was declined.
    RequiresPaymentMethod,
    /// `requires_confirmation`.
    RequiresConfirmation,
    /// `requires_action` (e.g. 3-D Secure).
    RequiresAction,
    /// `processing`.
    Processing,
    /// `requires_capture`: authorized; the funds are reserved until capture or cancel.
    RequiresCapture,
    /// `canceled` (final).
    Canceled,
    /// `succeeded`: captured (final; refunds do not change it).
    Succeeded,
    /// Any other value Stripe sends.
    Unknown(String),
}

impl PaymentIntentStatus {
    /// Every status this build knows.
    pub const KNOWN: [PaymentIntentStatus; 7] = [
        Self::RequiresPaymentMethod,
        Self::RequiresConfirmation,
        Self::RequiresAction,
        Self::Processing,
        Self::RequiresCapture,
        Self::Canceled,
        Self::Succeeded,
    ];

    /// Stripe's text for the status.
    pub fn as_str(&self) -> &str {
        match self {
            Self::RequiresPaymentMethod => "requires_payment_method",
            Self::RequiresConfirmation => "requires_confirmation",
            Self::RequiresAction => "requires_action",
            Self::Processing => "processing",
            Self::RequiresCapture => "requires_capture",
            Self::Canceled => "canceled",
            Self::Succeeded => "succeeded",
            Self::Unknown(s) => s,
        }
    }

    /// Waiting for the buyer to confirm with the client secret (the only statuses in which
    /// the owner is shown the secret).
    pub fn awaits_buyer(&self) -> bool {
        matches!(self, Self::RequiresPaymentMethod | Self::RequiresConfirmation | Self::RequiresAction)
    }

    /// Not yet authorized, captured or cancelled: a decline may still be recorded.
    pub fn is_unsettled(&self) -> bool {
        self.awaits_buyer() || matches!(self, Self::Processing)
    }

    /// Stripe never moves a PaymentIntent out of these.
    pub fn is_final(&self) -> bool {
        matches!(self, Self::Canceled | Self::Succeeded)
    }

    /// Whether the mirror may move from `self` to `next`. The mirror may skip states it never
    /// observed (a capture seen before its authorization), and may restate its status (amounts
    /// change on refunds), but never leaves a final status for another one: Stripe does not.
    pub fn can_transition_to(&self, next: &PaymentIntentStatus) -> bool {
        !self.is_final() || self == next
    }

    /// Every known status the table lets reach `to`.
    pub fn sources_of(to: &PaymentIntentStatus) -> Vec<PaymentIntentStatus> {
        Self::KNOWN.into_iter().filter(|from| from.can_transition_to(to)).collect()
    }
}

/// One change to the payment row mirroring a PaymentIntent: the provider's status and, where
/// the fact states them, amounts (minor units) and the last error code. Fields left `None`
/// keep what the row has.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PaymentUpdate {
    /// The PaymentIntent's status as the provider reports it.
    pub status: PaymentIntentStatus,
    /// Captured so far, minor units.
    pub amount_captured_minor: Option<i64>,
    /// Refunded so far, minor units.
    pub amount_refunded_minor: Option<i64>,
    /// Stripe's error code of the last failed operation (`decline_code` or `code`).
    pub last_error_code: Option<String>,
    /// What to record of the authorization's capture deadline.
    pub capture_before: CaptureDeadline,
}

impl PaymentUpdate {
    /// A status change alone.
    pub fn status(status: PaymentIntentStatus) -> Self {
        Self {
            status,
            amount_captured_minor: None,
            amount_refunded_minor: None,
            last_error_code: None,
            capture_before: CaptureDeadline::Keep,
        }
    }
}

/// What a [`PaymentUpdate`] records of an authorization's capture deadline (after which the
/// provider no longer captures it; case C09), in the same write as the status.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CaptureDeadline {
    /// Leave the recorded deadline as it is.
    #[default]
    Keep,
    /// The provider stated it (the charge's `capture_before`): record it.
    Known(chrono::DateTime<chrono::Utc>),
    /// None stated: when none is recorded yet, record the provider's default validity from
    /// now (`boxoffice_store::payments::DEFAULT_AUTHORIZATION_VALIDITY_DAYS`).
    DefaultIfUnknown,
}

impl From<&str> for PaymentIntentStatus {
    fn from(s: &str) -> Self {
        Self::KNOWN.into_iter().find(|x| x.as_str() == s).unwrap_or_else(|| Self::Unknown(s.to_owned()))
    }
}

impl From<String> for PaymentIntentStatus {
    fn from(s: String) -> Self {
        match Self::from(s.as_str()) {
            Self::Unknown(_) => Self::Unknown(s),
            known => known,
        }
    }
}

impl From<PaymentIntentStatus> for String {
    fn from(s: PaymentIntentStatus) -> Self {
        match s {
            PaymentIntentStatus::Unknown(s) => s,
            known => known.as_str().to_owned(),
        }
    }
}

impl fmt::Display for PaymentIntentStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<str> for PaymentIntentStatus {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for PaymentIntentStatus {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
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
        assert!(Ticketed.can_transition_to(Refunded), "a refund at the provider voids the tickets");
        for from in OrderStatus::ALL.into_iter().filter(|s| s.is_final()) {
            for to in OrderStatus::ALL {
                if from.can_transition_to(to) {
                    assert!(
                        matches!(to, Refunding | Refunded | Canceled),
                        "{from} -> {to} must not be legal"
                    );
                }
            }
        }
    }

    #[test]
    fn every_status_round_trips_through_its_text() {
        for s in HoldStatus::ALL {
            assert_eq!(s.as_str().parse::<HoldStatus>().unwrap(), s);
        }
        for s in PaymentIntentStatus::KNOWN {
            assert_eq!(PaymentIntentStatus::from(s.as_str()), s);
            assert_eq!(serde_json::to_value(&s).unwrap(), s.as_str());
        }
        let new = PaymentIntentStatus::from("requires_reauthorization");
        assert_eq!(new, PaymentIntentStatus::Unknown("requires_reauthorization".into()));
        assert_eq!(String::from(new), "requires_reauthorization");
    }

    #[test]
    fn holds_own_seats_until_they_leave_active_or_confirmed() {
        use HoldStatus::*;
        for from in HoldStatus::ALL {
            for to in HoldStatus::ALL {
                let legal = from.can_transition_to(to);
                assert_eq!(
                    legal,
                    matches!((from, to), (Active, Confirmed | Expired) | (Confirmed, Released))
                );
            }
        }
        assert!(!Confirmed.can_transition_to(Expired), "a confirmed hold never expires");
    }

    #[test]
    fn a_final_payment_status_is_never_left() {
        use PaymentIntentStatus as P;
        for from in P::KNOWN {
            for to in P::KNOWN {
                assert_eq!(from.can_transition_to(&to), !from.is_final() || from == to, "{from} -> {to}");
            }
        }
        assert!(!P::Canceled.can_transition_to(&P::Succeeded));
        assert!(P::RequiresPaymentMethod.can_transition_to(&P::Succeeded), "a mirror may skip states");
    }

    #[test]
    fn nothing_is_confirmed_after_expiry() {
        assert!(!Expired.can_transition_to(Confirming));
        assert!(!Canceled.can_transition_to(Confirming));
        assert!(!Ticketed.can_transition_to(Confirming));
    }
}
