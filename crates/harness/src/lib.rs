//! boxoffice-harness: what the drills (`boxoffice-drills onsale | bench | chaos`) and the
//! integration tests share to drive a boxoffice deployment from the outside, written once.
//!
//! - [`deploy`]: the in-process deployment — the Stripe simulator, the run's topics (on the
//!   configured or an embedded broker), any set of roles, and the webhook URL wiring.
//! - [`client`]: the buyer's HTTP client (every API request a buyer sends, the Stripe.js-like
//!   confirmation, the answers' shapes).
//! - [`buyers`]: the simulated buyers of an onsale (purchase journey, retries, report
//!   counts), with [`queue`] for their waiting-room phase and [`seatpick`] for picking
//!   adjacent seats off the seat map.
//! - [`drain`]: waiting until every order is final, every cancel recorded and the
//!   outbox empty.
//! - [`killswitch`]: a TCP forwarder that cuts every connection it carries and refuses new
//!   ones until restored (a network path failing), for the outage drills.
//! - [`noise`]: a reproducible noisy neighbour (busy processes for `--steal-cpu`).
//! - [`stats`]: latency histograms and percentiles.
//!
//! It drives the product through its public surfaces (HTTP, the runtime, the store's
//! read functions) and never changes the product's rules; the product binary does not
//! depend on it.

#![warn(missing_docs)]

pub mod buyers;
pub mod client;
pub mod deploy;
pub mod drain;
pub mod killswitch;
pub mod noise;
pub mod queue;
pub mod seatpick;
pub mod stats;
