//! Fault injection: what can go wrong between boxoffice and Stripe, on demand.
//!
//! Owns [`Faults`] (process-wide, changed at run time via `StripeSim::set_faults` or
//! `POST /_sim/faults`), the per-request `X-Sim-Fault` header, and the seeded RNG that draws
//! rate-based faults and shuffles webhook batches, so a run with the same seed and the same
//! request order injects the same faults.
//!
//! Invariant: "after apply" faults never skip the mutation; they only lose or corrupt the
//! answer, which is exactly the case idempotency keys exist for.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// Header carrying per-request faults: comma-separated `fail-after-apply`, `drop-response`,
/// `latency=<ms>`.
pub const FAULT_HEADER: &str = "x-sim-fault";

/// Process-wide faults. Every field defaults to "off"; JSON may give any subset.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Faults {
    /// Added to every `/v1` request, in milliseconds, after the idempotency key is claimed
    /// (so concurrent retries with the same key see `idempotency_key_in_use`).
    pub latency_ms: u64,
    /// Added to every read-only `/v1` request (a retrieve or a list) after it looked the
    /// ledger up and before its answer is sent, in milliseconds: the answer describes the state
    /// as it was when read, as a slow network on the way back makes it.
    pub answer_delay_ms: u64,
    /// Wait before delivering each webhook batch, in milliseconds.
    pub webhook_delay_ms: u64,
    /// Extra copies of every event delivered (same `evt_` id): 2 means each arrives 3 times.
    pub webhook_duplicates: u32,
    /// Deliver each batch (everything queued when a delivery round starts) in shuffled order.
    pub webhook_reorder: bool,
    /// Probability in [0, 1] that a mutating request is applied and then answered with
    /// 500 `api_error`. The real answer is still stored for idempotent replay.
    pub fail_after_apply_rate: f64,
    /// Probability in [0, 1] that a mutating request is applied and then never answered (the
    /// client times out). The real answer is still stored for idempotent replay.
    pub drop_response_rate: f64,
    /// Seed of the fault RNG; re-seeded whenever faults are set.
    pub seed: u64,
}

/// Faults requested for one request via [`FAULT_HEADER`].
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RequestFaults {
    pub fail_after_apply: bool,
    pub drop_response: bool,
    pub latency_ms: u64,
}

impl RequestFaults {
    /// Parses the header value; unknown entries are an error so typos do not silently pass.
    pub fn parse(value: Option<&str>) -> Result<Self, String> {
        let mut out = Self::default();
        for item in value.unwrap_or("").split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match item {
                "fail-after-apply" => out.fail_after_apply = true,
                "drop-response" => out.drop_response = true,
                _ => match item.strip_prefix("latency=").and_then(|ms| ms.parse().ok()) {
                    Some(ms) => out.latency_ms = ms,
                    None => return Err(format!("unknown {FAULT_HEADER} entry: {item}")),
                },
            }
        }
        Ok(out)
    }
}

/// What happens after a mutation has been applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AfterApply {
    Answer,
    Fail500,
    DropResponse,
}

/// The current faults and the RNG drawing from them.
pub(crate) struct FaultState {
    pub faults: Faults,
    rng: StdRng,
}

impl FaultState {
    pub fn new(faults: Faults) -> Self {
        let rng = StdRng::seed_from_u64(faults.seed);
        Self { faults, rng }
    }

    /// Replaces the faults and re-seeds the RNG.
    pub fn set(&mut self, faults: Faults) {
        *self = Self::new(faults);
    }

    /// Latency for a request: the per-request value if given, else the global one.
    pub fn latency_ms(&self, req: RequestFaults) -> u64 {
        if req.latency_ms > 0 {
            req.latency_ms
        } else {
            self.faults.latency_ms
        }
    }

    /// Decides the fate of a mutating request's answer.
    pub fn after_apply(&mut self, req: RequestFaults) -> AfterApply {
        let (drop_rate, fail_rate) = (self.faults.drop_response_rate, self.faults.fail_after_apply_rate);
        if req.drop_response || self.draw(drop_rate) {
            AfterApply::DropResponse
        } else if req.fail_after_apply || self.draw(fail_rate) {
            AfterApply::Fail500
        } else {
            AfterApply::Answer
        }
    }

    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        items.shuffle(&mut self.rng);
    }

    /// True with probability `p`; `p` ≤ 0 or NaN never, ≥ 1 always (no draw either way, so
    /// turning one fault on does not shift the others' sequence).
    fn draw(&mut self, p: f64) -> bool {
        if p.is_nan() || p <= 0.0 {
            false
        } else if p >= 1.0 {
            true
        } else {
            self.rng.gen_bool(p)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_parsing() {
        let f = RequestFaults::parse(Some("fail-after-apply, latency=25")).unwrap();
        assert!(f.fail_after_apply && !f.drop_response && f.latency_ms == 25);
        assert!(RequestFaults::parse(Some("explode")).is_err());
        assert!(!RequestFaults::parse(None).unwrap().drop_response);
    }

    #[test]
    fn rates_are_seeded() {
        let faults = Faults { fail_after_apply_rate: 0.5, seed: 7, ..Faults::default() };
        let draws =
            |mut s: FaultState| (0..64).map(|_| s.after_apply(RequestFaults::default())).collect::<Vec<_>>();
        let a = draws(FaultState::new(faults.clone()));
        assert_eq!(a, draws(FaultState::new(faults)));
        assert!(a.contains(&AfterApply::Fail500) && a.contains(&AfterApply::Answer));
    }
}
