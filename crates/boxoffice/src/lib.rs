//! The boxoffice binary's library half: configuration, the role runtime, and the commands
//! (`migrate`, `serve`, `seed-venue`, `stripe-sim`, `onsale`, `bench`, `audit`, `reconcile`,
//! `dlq`, `topics create`, `chaos`).
//! Integration tests drive the same functions the binary does.

pub mod audit;
pub mod bench;
pub mod chaos;
pub mod commands;
pub mod config;
pub mod onsale;
pub mod reconcile;
pub mod runtime;

pub use config::Config;
