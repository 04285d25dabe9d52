//! boxoffice's HTTP API (axum). Handlers are thin: they authenticate, validate and call the
//! ledger ([`boxoffice_store`]); every error leaves through [`problem::Problem`] as an
//! RFC 9457 `application/problem+json` body with the right status code.
//!
//! Routes:
//! - `POST /events/{event_id}/queue`, `GET|DELETE /queue/{ticket}` — the waiting room: join,
//!   poll (the admission token once released), leave;
//! - `POST /events/{event_id}/admission` — admission at once, only with `admission_direct`;
//! - `POST /events/{event_id}/holds` — the hold transaction (invariants 1 and 3);
//! - `GET  /orders/{order_id}` — the owner's view of the workflow (404 for anyone else);
//! - `GET  /events/{event_id}/seats` — availability map, cached per event ≤ 1 s (a hint,
//!   never a promise);
//! - `POST /webhooks/stripe` — signature-verified, deduplicated webhook ingress (invariant 4);
//! - `GET  /healthz`, `GET /readyz`, `GET /metrics`, `GET /openapi.json`;
//! - `GET  /admin/` (the operator's onsale dashboard, a static page) and `GET /admin/onsale`
//!   (its figures, operator token only) — [`admin`], [`dashboard`].
//!
//! Every buyer route sits behind per-IP and per-user rate buckets ([`limits`]); every
//! connection behind the edge's timeouts and limits ([`edge`]).

pub mod admin;
pub mod auth;
pub mod cell_router;
pub mod dashboard;
pub mod edge;
pub mod limits;
pub mod openapi;
pub mod order_stream;
pub mod problem;
pub mod queue;
pub mod revocation;
pub mod routes;
pub mod spans;
pub mod state;
pub mod timeline;
pub mod webhooks;

pub use edge::{serve, EdgeSettings};
pub use routes::router;
pub use state::{ApiSettings, AppState};
