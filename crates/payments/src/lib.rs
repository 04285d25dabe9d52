//! boxoffice-payments: the only place that speaks Stripe.
//!
//! Owns the [`PaymentGateway`] trait (what the payment worker and saga may ask of a payment
//! provider), its production implementation [`StripeClient`] (a thin hand-written client over
//! Stripe's form-encoded HTTP API), the Stripe object shapes we read ([`PaymentIntent`],
//! [`Refund`]), the error taxonomy ([`StripeError`], which decides once whether a failure is
//! retryable), and webhook signature verification ([`webhook`]).
//!
//! Invariants protected here:
//! - every mutating call carries the caller's stable `Idempotency-Key`, so a retried worker
//!   replays Stripe's first answer instead of authorizing, capturing or refunding twice
//!   (design §10, <https://docs.stripe.com/api/idempotent_requests>);
//! - client secrets and secret keys never reach logs, error messages or `Debug` output;
//! - a webhook is trusted only after its `Stripe-Signature` matches the raw body.
//!
//! The client does not retry by itself: callers (worker loops) consult
//! [`StripeError::is_retryable`] and retry with the same idempotency key.

#![warn(missing_docs)]

mod client;
mod error;
mod types;
pub mod webhook;

pub use client::{is_stripe_api, KeyMode, PaymentGateway, StripeClient, StripeConfig, STRIPE_API_HOST};
pub use error::StripeError;
pub use types::{
    CardDetails, Charge, CreatePaymentIntent, CreatedWindow, Dispute, IntentWithCharge, PaymentIntent,
    PaymentIntentStatus, PaymentMethodDetails, Refund,
};
