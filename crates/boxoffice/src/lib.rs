//! The boxoffice binary's library half: configuration, the role runtime, and the product's
//! commands (`migrate`, `serve`, `seed-venue`, `audit`, `reconcile`, `dlq`, `topics create`,
//! the waiting-room and admission-key commands, `cells`, `region`, `timeline`). The drills (`boxoffice-drills`) and the
//! integration tests drive the same functions the binary does.

#![warn(missing_docs)]

pub mod audit;
pub mod cells;
pub mod commands;
pub mod config;
#[cfg(test)]
mod observability;
pub mod reconcile;
pub mod region;
pub mod runtime;
pub mod telemetry;
pub mod timeline;

pub use config::Config;
