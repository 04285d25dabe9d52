//! The boxoffice binary's library half: configuration, the role runtime, and the commands
//! (`migrate`, `serve`, `seed-venue`, `stripe-sim`, `onsale`, `audit`, `topics create`).
//! Integration tests drive the same functions the binary does.

pub mod commands;
pub mod config;
pub mod onsale;
pub mod runtime;

pub use config::Config;
