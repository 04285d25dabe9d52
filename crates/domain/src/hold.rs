//! How long a hold lives (case C19): the one statement of the hold's lifetime rules, which the
//! store applies in SQL with the database clock and the configuration sets.
//!
//! A hold is created with `expires_at = now + ttl`. Two events may move its end later, never
//! earlier, and never for a hold that has already lapsed (by every rule below):
//!
//! 1. **The payment window.** Until the order becomes payable (its PaymentIntent is
//!    recorded, so `GET /orders/{id}` shows the client secret) the hold does not lapse before
//!    `created_at + ceiling` (`payable_by`), whatever its TTL: the buyer cannot pay yet, so
//!    the wait is ours. When it becomes payable, the buyer is owed at least
//!    `payment_window`: `expires_at ← max(expires_at, now + payment_window)`, capped at
//!    `created_at + ceiling`, and the wait ends. However far the pipeline lags before the
//!    PaymentIntent exists (up to the ceiling less the window), the buyer who sees a client
//!    secret has the whole window to pay; past that the release controller has long lowered R.
//! 2. **An authorization reported in time.** When the provider reports an authorization of
//!    the order's current PaymentIntent (a webhook, or a re-fetch) while the hold is live,
//!    the hold is protected until the saga settles it: `authorized_until ← min(now +
//!    settle, capture_before − margin)`; for a webhook claim, which is not checked yet, `now`
//!    is the first claim no re-fetch has refuted since, so repeated claims extend nothing. A
//!    hold is lapsed only when both `expires_at` and `authorized_until` are past, so neither
//!    the expiry worker nor a competing hold takes its seats while the saga catches up. A
//!    claim the provider refutes clears the protection — unless a claim about the
//!    PaymentIntent came while that re-fetch's call was under way (an authorization of a
//!    buyer who paid meanwhile, say): then the protection, and rule 3's wait, stand until the
//!    re-fetch asked once more has spoken. A claim no re-fetch will check (past the
//!    PaymentIntent's re-fetch budgets) protects nothing: the hold reaches its end, and rule
//!    3 asks. Invariant 2 is unchanged: the saga confirms only an active hold that has
//!    not lapsed by this rule, with an authorization it has verified.
//! 3. **The provider is asked before a payable hold lapses.** A webhook may be late (the
//!    provider retries for days) or starved by our own load, so the ledger's silence is not
//!    the provider's. When a payable hold reaches its end and the ledger knows of no
//!    authorization of its PaymentIntent, the expiry worker does not release it: it asks
//!    for a re-fetch of the PaymentIntent and the hold waits up to `provider_check`
//!    (`provider_check_until`). An authorization found is rule 2's report in time; any
//!    other answer ends the wait at once and the hold lapses. One check per hold; a check
//!    that does not come back within `provider_check` (the payment worker lags too) ends
//!    the wait anyway, and a later authorization is compensated as before. The wait is part
//!    of the hold's end: `provider_check_until` is set to `expires_at + provider_check` when
//!    the order becomes payable, so while an answer is pending any authorization reported
//!    (a webhook too) protects the hold, including one made after the `hold_expires_at` the
//!    buyer was shown, and rivals see the seats taken that long. With the payment worker
//!    keeping up, the answer comes within a second of `expires_at`.
//!
//! The invariant protected: a buyer the system admitted never loses seats or money to the
//! system's own lag (design §3, "kind under load").

use std::time::Duration;

/// The lifetime rules of holds; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HoldPolicy {
    /// A new hold's time to live.
    pub ttl: Duration,
    /// The least time between the order becoming payable and the hold's expiry.
    pub payment_window: Duration,
    /// The latest a payment window may push `expires_at`, counted from the hold's creation
    /// (≥ `ttl`).
    pub ceiling: Duration,
    /// How long an authorization reported in time protects the hold, at most (also bounded
    /// by the authorization's capture deadline less [`HoldPolicy::CAPTURE_MARGIN`]).
    pub settle: Duration,
    /// How long a payable hold at its end waits for the provider's word on its
    /// PaymentIntent (rule 3), at most ([`HoldPolicy::MAX_PROVIDER_CHECK`]); zero turns the
    /// check off.
    pub provider_check: Duration,
}

impl HoldPolicy {
    /// How long before the provider's capture deadline the protection of an authorized hold
    /// ends (the saga must capture before then; case C09 cancels what it cannot).
    pub const CAPTURE_MARGIN: Duration = Duration::from_secs(3_600);

    /// The longest `provider_check`: unpaid seats are kept that long when the payment
    /// worker is down.
    pub const MAX_PROVIDER_CHECK: Duration = Duration::from_secs(600);

    /// The defaults for `ttl`: a payment window of 90 % of it, a ceiling of three TTLs,
    /// 30 minutes of protection for an authorization reported in time, and 30 s for the
    /// provider check of rule 3.
    pub fn for_ttl(ttl: Duration) -> Self {
        Self {
            ttl,
            payment_window: ttl.mul_f64(0.9),
            ceiling: ttl * 3,
            settle: Duration::from_secs(30 * 60),
            provider_check: Duration::from_secs(30),
        }
    }

    /// Checks the rules' own consistency: a window and a settle time above zero, and a
    /// ceiling no shorter than the TTL nor than the window.
    pub fn validate(&self) -> Result<(), String> {
        if self.payment_window.is_zero() || self.settle.is_zero() {
            return Err("payment_window and settle must be above zero".into());
        }
        if self.provider_check > Self::MAX_PROVIDER_CHECK {
            return Err(format!("the provider check may wait at most {:?}", Self::MAX_PROVIDER_CHECK));
        }
        if self.ceiling < self.ttl || self.ceiling < self.payment_window {
            return Err(format!(
                "the hold ceiling ({:?}) must be at least the TTL ({:?}) and the payment window ({:?})",
                self.ceiling, self.ttl, self.payment_window
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_the_ttl_and_are_consistent() {
        let p = HoldPolicy::for_ttl(Duration::from_secs(60));
        assert_eq!((p.payment_window, p.ceiling), (Duration::from_secs(54), Duration::from_secs(180)));
        p.validate().unwrap();
        assert!(HoldPolicy { ceiling: Duration::from_secs(30), ..p }.validate().is_err());
        assert!(HoldPolicy { payment_window: Duration::ZERO, ..p }.validate().is_err());
        assert!(HoldPolicy { provider_check: Duration::from_secs(601), ..p }.validate().is_err());
    }
}
