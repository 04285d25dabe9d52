//! boxoffice-drills: everything that exercises boxoffice from the outside, apart from the
//! product binary — the `boxoffice-drills` binary's subcommands and the integration tests.
//!
//! - [`onsale`] (`boxoffice-drills onsale`): the main job, a whole onsale with simulated
//!   buyers through the HTTP API, then the audit and the report.
//! - [`bench`](mod@bench) (`boxoffice-drills bench`): the capacity measurements of design §12.
//! - [`chaos`] (`boxoffice-drills chaos`): an onsale with every role as its own
//!   `boxoffice serve` process under a seeded schedule of crashes and outages.
//! - [`cells`] (`boxoffice-drills cells`): two purchase cells selling at once while one
//!   loses its database; the other must keep its rate, the first must recover (design §13).
//! - [`failover`] (`boxoffice-drills drill failover`): the warm-region failover drill
//!   (design §15): replication cut, the primary region lost, the runbook run, the old
//!   primary back as a zombie; RPO, RTO and old-epoch writes counted.
//! - [`pgcluster`]: the PostgreSQL pair of the warm-region failover drill — a primary and
//!   its asynchronous streaming replica, created and removed by the drill, with replication
//!   through a relay it can cut.
//! - [`stripe_sim`] (`boxoffice-drills stripe-sim`): the Stripe simulator's server.
//!
//! What they share with each other and with the tests (the in-process deployment, the buyer
//! client and the simulated buyers, the drain loop, latency statistics) lives once in
//! `boxoffice-harness`; the drills do not import each other.
//!
//! The integration tests (`tests/it`, the workspace's one integration-test binary for
//! boxoffice) live in this crate because it is the only place that can reach both binaries:
//! cargo builds a package's own binaries for its integration tests
//! (`CARGO_BIN_EXE_boxoffice-drills`), and this crate already depends on the product's
//! library for everything else the tests call. The product binary is a different package,
//! so the tests, like the chaos drill, find it as the `boxoffice` file next to
//! `boxoffice-drills` in the same target directory; `scripts/test` builds every binary of
//! the workspace before it runs the suite, so that file is never stale or missing.
//! Placing the tests in the product crate instead would make `boxoffice` reachable and
//! `boxoffice-drills` not, with the same problem reversed and the drills as the product's
//! dependency.

#![warn(missing_docs)]

pub mod bench;
pub mod cells;
pub mod chaos;
pub mod failover;
pub mod onsale;
pub mod pgcluster;
pub mod stripe_sim;
