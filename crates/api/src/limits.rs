//! Rate buckets in front of every buyer route: one per client address (see
//! [`crate::edge::client_ip`]; IPv6 by /64) and one per authenticated user, GCRA buckets in
//! Redis shared by every API process ([`boxoffice_waitroom::Waitroom::take`]).
//!
//! Four route classes have buckets of their own, so polling an order does not eat the
//! budget of joining the queue:
//! - **queue** — `POST /events/{id}/queue`, `GET|DELETE /queue/{ticket}`: per IP and per user;
//! - **purchase** — `POST /events/{id}/admission`, `POST /events/{id}/holds`,
//!   `GET /orders/{id}`: per IP and per user;
//! - **seats** — `GET /events/{id}/seats` (unauthenticated): per IP;
//! - **admin** — every `/admin` route (the operator's, [`crate::admin`]): per IP, taken
//!   before the operator token is checked, so guessing tokens is as slow as the bucket.
//!
//! Over a bucket → 429 `rate_limited` problem+json with `Retry-After` (seconds) and `scope`
//! (`ip` or `user`). A request without a valid bearer token skips the user bucket (the
//! handler answers 401).
//!
//! When Redis cannot answer:
//! - **queue** routes answer 503 `waitroom_unavailable` — they need Redis anyway, and wait
//!   for it up to `queue_timeout_ms` ([`Patience::Queue`]) rather than the hold path's
//!   shorter bound;
//! - **purchase**, **seats** and **admin** routes fail open onto an in-process fallback limiter
//!   (`governor`'s keyed GCRA, the same rates, per process instead of per deployment): the
//!   hold path must not depend on Redis, and a limit per process still stops one client from
//!   hammering one instance. Counted in `boxoffice_rate_limit_fallback_total{route}`. After
//!   Redis timed out or refused, these routes skip it for [`SKIP_REDIS_AFTER_FAILURE`]
//!   ([`boxoffice_waitroom::Waitroom::recently_unavailable`]), so a Redis that stops
//!   answering does not add `redis_timeout_ms` to every hold.
//!
//! The fallback keeps at most [`FALLBACK_MAX_KEYS`] clients per bucket; past that it forgets
//! the idle ones, and if they are all recent it starts over (a flood of addresses then gets
//! fresh buckets, no worse than the per-process limit it replaces).

use crate::edge::{bucket_key, client_ip};
use crate::problem::Problem;
use crate::state::AppState;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use boxoffice_waitroom::{Bucket, Patience, RateDecision};
use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota};
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// How long the purchase and seats routes skip Redis after it was unavailable.
pub const SKIP_REDIS_AFTER_FAILURE: Duration = Duration::from_secs(1);

/// Clients remembered per fallback bucket before it is pruned.
pub const FALLBACK_MAX_KEYS: usize = 100_000;

/// The buckets of one route class (`None` = off).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RouteBuckets {
    /// Per client address.
    pub ip: Option<Bucket>,
    /// Per authenticated user.
    pub user: Option<Bucket>,
}

/// The buckets of every route class.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RateLimits {
    /// Waiting-room routes.
    pub queue: RouteBuckets,
    /// Admission, holds and order status.
    pub purchase: RouteBuckets,
    /// The seat map (only `ip` is used).
    pub seats: RouteBuckets,
    /// The operator's `/admin` routes (only `ip` is used).
    pub admin: RouteBuckets,
}

/// A class of routes sharing buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RouteClass {
    /// Waiting-room routes (Redis down → 503).
    Queue,
    /// Admission, holds, order status (Redis down → fallback limiter).
    Purchase,
    /// The seat map (Redis down → fallback limiter).
    Seats,
    /// The operator's routes (Redis down → fallback limiter).
    Admin,
}

impl RouteClass {
    /// The name in metrics and Redis keys.
    pub fn name(self) -> &'static str {
        match self {
            Self::Queue => "queue",
            Self::Purchase => "purchase",
            Self::Seats => "seats",
            Self::Admin => "admin",
        }
    }

    fn buckets(self, l: &RateLimits) -> RouteBuckets {
        match self {
            Self::Queue => l.queue,
            Self::Purchase => l.purchase,
            Self::Seats => RouteBuckets { user: None, ..l.seats },
            Self::Admin => RouteBuckets { user: None, ..l.admin },
        }
    }

    /// The Redis bucket name of `scope`; the queue's keep their historical names.
    fn redis_scope(self, scope: Scope) -> &'static str {
        match (self, scope) {
            (Self::Queue, Scope::Ip) => "ip",
            (Self::Queue, Scope::User) => "user",
            (Self::Purchase, Scope::Ip) => "purchase:ip",
            (Self::Purchase, Scope::User) => "purchase:user",
            (Self::Seats, Scope::Ip) => "seats:ip",
            (Self::Seats, Scope::User) => "seats:user",
            (Self::Admin, Scope::Ip) => "admin:ip",
            (Self::Admin, Scope::User) => "admin:user",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Scope {
    Ip,
    User,
}

impl Scope {
    fn name(self) -> &'static str {
        match self {
            Self::Ip => "ip",
            Self::User => "user",
        }
    }
}

type Limiter = DefaultKeyedRateLimiter<String>;

/// The in-process limiters used while Redis cannot answer, one per (class, scope), created
/// on first use with that bucket's rate.
#[derive(Default)]
pub struct FallbackLimiter {
    limiters: RwLock<std::collections::HashMap<(RouteClass, Scope), Arc<Limiter>>>,
}

impl std::fmt::Debug for FallbackLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FallbackLimiter").finish_non_exhaustive()
    }
}

fn quota(b: Bucket) -> Quota {
    let period = Duration::from_secs_f64(1.0 / b.per_s.max(1e-3));
    let burst = NonZeroU32::new(b.burst.max(1)).expect("burst >= 1");
    Quota::with_period(period.max(Duration::from_nanos(1))).expect("non-zero period").allow_burst(burst)
}

impl FallbackLimiter {
    fn limiter(&self, class: RouteClass, scope: Scope, b: Bucket) -> Arc<Limiter> {
        if let Some(l) = self.limiters.read().expect("fallback limiter poisoned").get(&(class, scope)) {
            if l.len() <= FALLBACK_MAX_KEYS {
                return l.clone();
            }
        }
        let mut map = self.limiters.write().expect("fallback limiter poisoned");
        let l = map.entry((class, scope)).or_insert_with(|| Arc::new(Limiter::dashmap(quota(b))));
        if l.len() > FALLBACK_MAX_KEYS {
            l.retain_recent();
            if l.len() > FALLBACK_MAX_KEYS {
                *l = Arc::new(Limiter::dashmap(quota(b)));
            }
        }
        l.clone()
    }

    /// Takes one request for `key` from the in-process bucket of (`class`, `scope`).
    fn take(&self, class: RouteClass, scope: Scope, key: &str, b: Bucket) -> RateDecision {
        let l = self.limiter(class, scope, b);
        match l.check_key(&key.to_owned()) {
            Ok(()) => RateDecision::Allowed,
            Err(not_until) => RateDecision::Limited {
                retry_after_ms: not_until.wait_time_from(DefaultClock::default().now()).as_millis().max(1)
                    as u64,
            },
        }
    }
}

/// Middleware of the queue routes.
pub(crate) async fn queue(State(st): State<AppState>, req: Request, next: Next) -> Response {
    limit(st, RouteClass::Queue, req, next).await
}

/// Middleware of the purchase routes.
pub(crate) async fn purchase(State(st): State<AppState>, req: Request, next: Next) -> Response {
    limit(st, RouteClass::Purchase, req, next).await
}

/// Middleware of the seat map.
pub(crate) async fn seats(State(st): State<AppState>, req: Request, next: Next) -> Response {
    limit(st, RouteClass::Seats, req, next).await
}

/// Middleware of the operator's routes.
pub(crate) async fn admin(State(st): State<AppState>, req: Request, next: Next) -> Response {
    limit(st, RouteClass::Admin, req, next).await
}

async fn limit(st: AppState, class: RouteClass, req: Request, next: Next) -> Response {
    let buckets = class.buckets(&st.settings.rate_limits);
    if let Some(b) = buckets.ip {
        let peer = req.extensions().get::<ConnectInfo<SocketAddr>>().map(|ConnectInfo(a)| a.ip());
        let key = client_ip(peer, req.headers(), st.settings.trusted_proxy_hops)
            .map(bucket_key)
            .unwrap_or_else(|| "unknown".into());
        if let Err(p) = take(&st, class, Scope::Ip, &key, b).await {
            return p.into_response();
        }
    }
    if let Some(b) = buckets.user {
        let user = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|h| h.strip_prefix("Bearer "))
            .and_then(|t| st.users.verify(t.trim()).ok());
        if let Some(u) = user {
            if let Err(p) = take(&st, class, Scope::User, &u.0.to_string(), b).await {
                return p.into_response();
            }
        }
    }
    next.run(req).await
}

async fn take(st: &AppState, class: RouteClass, scope: Scope, id: &str, b: Bucket) -> Result<(), Problem> {
    let decision = if class != RouteClass::Queue && st.waitroom.recently_unavailable(SKIP_REDIS_AFTER_FAILURE)
    {
        fallback(st, class, scope, id, b)
    } else {
        let patience = if class == RouteClass::Queue { Patience::Queue } else { Patience::FailFast };
        match st.waitroom.take(class.redis_scope(scope), id, b, patience).await {
            Ok(d) => d,
            Err(e) if class == RouteClass::Queue => return Err(e.into()),
            // Already counted and logged by the waiting room.
            Err(_) => fallback(st, class, scope, id, b),
        }
    };
    match decision {
        RateDecision::Allowed => Ok(()),
        RateDecision::Limited { retry_after_ms } => {
            metrics::counter!("boxoffice_rate_limited_total", "scope" => scope.name(), "route" => class.name())
                .increment(1);
            Err(Problem::rate_limited(scope.name(), retry_after_ms))
        }
    }
}

fn fallback(st: &AppState, class: RouteClass, scope: Scope, id: &str, b: Bucket) -> RateDecision {
    metrics::counter!("boxoffice_rate_limit_fallback_total", "route" => class.name()).increment(1);
    st.fallback_limiter.take(class, scope, id, b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fallback_limits_per_key_with_the_buckets_rate() {
        let f = FallbackLimiter::default();
        let b = Bucket { per_s: 1.0, burst: 2 };
        let take = |k: &str| f.take(RouteClass::Purchase, Scope::Ip, k, b);
        assert_eq!(take("a"), RateDecision::Allowed);
        assert_eq!(take("a"), RateDecision::Allowed);
        match take("a") {
            RateDecision::Limited { retry_after_ms } => assert!((1..=1_000).contains(&retry_after_ms)),
            d => panic!("the third request within a second must be limited: {d:?}"),
        }
        assert_eq!(take("b"), RateDecision::Allowed, "another client has its own bucket");
        assert_eq!(
            f.take(RouteClass::Seats, Scope::Ip, "a", b),
            RateDecision::Allowed,
            "another route class has its own bucket"
        );
    }
}
