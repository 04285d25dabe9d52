//! Money in integer minor currency units (cents for USD), never floating point.

use serde::{Deserialize, Serialize};

/// An amount in minor units (e.g. `12550` = 125.50 USD) with its ISO 4217 currency code in
/// lower case, as Stripe expects (`"usd"`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Money {
    /// Amount in minor units; never negative for a price.
    pub amount_minor: i64,
    /// Lower-case ISO 4217 code.
    pub currency: String,
}

impl Money {
    /// Builds an amount; the currency is lower-cased.
    pub fn new(amount_minor: i64, currency: &str) -> Self {
        Self { amount_minor, currency: currency.to_ascii_lowercase() }
    }
}
