//! The HTTP edge: how connections are accepted and bounded before any handler runs, and who
//! the client is.
//!
//! Every connection is served by hyper's HTTP/1.1 connection builder with a timer, so a
//! client that does not finish its request head within `header_read_timeout` is cut off —
//! whether it sends half a request line and stops, opens a connection and sends nothing, or
//! idles on a kept-alive connection between requests (hyper starts the timer whenever it
//! waits for a head). Above the router sit, outermost first:
//!
//! 1. the problem mapper ([`crate::problem::ensure_problem`]): any error answer a layer or
//!    extractor produced without a problem+json body gets one;
//! 2. a concurrency limit of `max_concurrent_requests` requests in flight that sheds instead
//!    of queueing: beyond it the answer is at once 503 `overloaded` with `Retry-After`
//!    (`tower::load_shed` over `tower::limit::ConcurrencyLimit`);
//! 3. a whole-request timeout (`tower_http::timeout::TimeoutLayer`, 503 `request_timeout`
//!    with `Retry-After`): a handler still running after `request_timeout` is dropped, which
//!    rolls back its open transaction, so a retry with the same `Idempotency-Key` is safe;
//! 4. a request-body read timeout (`tower_http::timeout::RequestBodyTimeoutLayer`): a body
//!    that stalls for `body_read_timeout` between two chunks is a 408 `request_body_timeout`.
//!
//! Connections beyond `max_connections` are still read (with the same header timeout) but
//! answered 503 `overloaded` with `Retry-After` and closed; beyond a further
//! `max_connections / 8` (at least 16) they are closed at once, so a flood of sockets costs
//! a bounded number of tasks. There is no other listener in the product: `/metrics`,
//! `/healthz` and `/readyz` are served here, behind the same bounds — except that `/healthz`
//! is answered `ok` when the concurrency limit is full ([`shed_process`]).
//!
//! [`client_ip`] decides which address a request is counted against (the per-IP rate
//! buckets and [`PerClientInFlight`]) and where a webhook comes from
//! ([`webhook_source_refusal`]): the socket's peer, or an `X-Forwarded-For` entry when the
//! deployment trusts a number of proxy hops; [`bucket_key`] groups IPv6 clients by their /64.
//!
//! A rate bucket counts requests as they start, so a client that keeps each request open
//! (a body trickled byte by byte until the request timeout) would take many slots of the
//! process-wide limit at a modest rate. [`PerClientInFlight`] bounds the requests one client
//! address has in flight at once, on each route class it guards (buyer routes, webhook
//! ingress): one more is 429 `too_many_in_flight` at once, before its body is read.
//!
//! Metrics: `boxoffice_http_connections` (open connections), `boxoffice_http_connections_shed_total{how}`
//! (`answered_503`, `closed`), `boxoffice_http_requests_shed_total{bulkhead}` (503 `overloaded`,
//! by the limit that shed it: `process`, `queue`, `webhooks`, `ops`),
//! `boxoffice_http_retry_after_widened_total{routes}` (503s whose `Retry-After` a
//! [`RefusalBackoff`] widened), `boxoffice_http_header_timeouts_total`.
//!
//! A route class refused for seconds on end (the waiting room's, whose crowd is the largest)
//! tells its refused clients to come back later and later ([`RefusalBackoff`]: every 503 of
//! its routes, the ones its own bulkhead sheds among them, not those of the process-wide limit
//! or timeout above the router), so that shed clients do not return every few seconds and
//! keep the overload going.

use crate::problem::Problem;
use axum::error_handling::HandleErrorLayer;
use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, Request};
use axum::response::IntoResponse;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tower::{BoxError, ServiceBuilder, ServiceExt};
use tower_http::timeout::{RequestBodyTimeoutLayer, TimeoutLayer};

/// The bounds of the HTTP edge.
#[derive(Debug, Clone)]
pub struct EdgeSettings {
    /// Longest wait for a complete request head (request line and headers), from the
    /// connection's start or the end of the previous response on a kept-alive connection;
    /// past it the connection is closed without an answer.
    pub header_read_timeout: Duration,
    /// Longest time one request may take, body read included; past it the answer is 503
    /// `request_timeout` with `Retry-After` and the handler is dropped.
    pub request_timeout: Duration,
    /// Longest pause between two chunks of a request body; past it the answer is 408
    /// `request_body_timeout`.
    pub body_read_timeout: Duration,
    /// Requests in flight at once (≥ 1); one more is answered 503 `overloaded` at once.
    pub max_concurrent_requests: usize,
    /// Open connections served normally (≥ 1); see the module doc for what happens beyond.
    pub max_connections: usize,
}

impl Default for EdgeSettings {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(15),
            body_read_timeout: Duration::from_secs(5),
            max_concurrent_requests: 512,
            max_connections: 4_096,
        }
    }
}

/// The answer to a request shed by a concurrency limit (or any other error a layer raised),
/// counted in `boxoffice_http_requests_shed_total{bulkhead}` by the limit that shed it:
/// `process` (the edge's `max_concurrent_requests`), or the route class's [`bulkhead`].
pub(crate) async fn shed(e: BoxError, bulkhead: &'static str) -> Problem {
    if e.is::<tower::load_shed::error::Overloaded>() {
        metrics::counter!("boxoffice_http_requests_shed_total", "bulkhead" => bulkhead).increment(1);
        Problem::overloaded()
    } else {
        Problem::internal(&*e)
    }
}

/// What the process's concurrency limit answers when it is full: `200 ok` for `/healthz`
/// (liveness: it reads nothing, and a process shedding its excess is alive — a load balancer
/// that took it for a dead one would move its whole load onto the others, and slow bodies
/// from a few addresses could take every instance out), [`shed`] for everything else.
async fn shed_process(uri: axum::http::Uri, e: BoxError) -> axum::response::Response {
    if uri.path() == "/healthz" && e.is::<tower::load_shed::error::Overloaded>() {
        return "ok".into_response();
    }
    shed(e, "process").await.into_response()
}

/// A bulkhead for one class of routes, named `name` in the shed counter ([`shed`]): at most
/// `max` requests of every route and method it is layered on in flight together (one
/// semaphore, not one per method as `route_layer` would give `concurrency_limit`), more shed
/// at once with 503 `overloaded` rather than queued. `max` 0 is taken as 1.
pub(crate) fn bulkhead(
    name: &'static str,
    max: usize,
) -> impl tower::Layer<
    axum::routing::Route,
    Service: tower::Service<
        axum::extract::Request,
        Response = axum::response::Response,
        Error = std::convert::Infallible,
        Future: Send + 'static,
    > + Clone
                 + Send
                 + Sync
                 + 'static,
> + Clone
       + Send
       + Sync
       + 'static {
    tower::ServiceBuilder::new()
        .layer(axum::error_handling::HandleErrorLayer::new(move |e| shed(e, name)))
        .load_shed()
        .layer(tower::limit::GlobalConcurrencyLimitLayer::new(max.max(1)))
}

/// A route class's answer to a crowd it keeps refusing: while its 503 answers (shed by its
/// bulkhead, its dependency unavailable: every 503 of its routes) keep coming, each one's
/// `Retry-After` is widened, so the refused clients come back spread over a longer time
/// instead of every 1–3 s, each retry meeting the same overload (a retry storm that outlasts
/// its cause).
///
/// A streak starts with a 503 and ends after [`RefusalBackoff::QUIET`] without one. In its
/// first second the answers are left as they are; after `s` whole seconds of it, a
/// `Retry-After` is at least a draw from 1 s to `3 × 2^s` s, capped at `max_s`
/// ([`RefusalBackoff::window_s`]); an answer's own longer `Retry-After` is kept. The waiting
/// room sets `max_s` to a sixth of `waitroom_abandon_after_ms` ([`crate::routes::router`]):
/// a buyer told to poll after a third of it (the longest advice while
/// `waitroom_poll_interval_ms` is at most a third, as by default) keeps its position through
/// three refusals in a row at the cap, with a sixth of it (20 s by default) to spare for
/// latency. The state is per process: any 503 at least every [`RefusalBackoff::QUIET`]
/// (clients that ignore `Retry-After`, a flaky dependency) keeps the streak going for
/// everyone on that process, and the buyers who obey it then try less often. So that they
/// do not lose their positions for it, runs of the refusals the noting names (the waiting
/// room could not answer, not e.g. the database) are reported to the waiting room
/// ([`RefusalBackoff::noting`], `Waitroom::note_refused`), whose lapse clock does not count
/// that time (up to its grace: three times the lapse time by default); a trickle of 503s
/// among answered polls stops no clock. Widened answers are counted in
/// `boxoffice_http_retry_after_widened_total{routes}`.
pub struct RefusalBackoff {
    routes: &'static str,
    origin: std::time::Instant,
    max_s: u64,
    /// The current streak (`None` before the first refusal). One lock for all of it, so a
    /// refusal never pairs one streak's start with another's latest; it is taken only on a
    /// 503.
    streak: std::sync::Mutex<Option<Streak>>,
    /// Answers (2xx) so far (one relaxed increment each).
    answered: std::sync::atomic::AtomicU64,
    /// The problem codes whose refusals are noted, and whom to tell ([`Self::noting`]).
    noted: Option<(&'static [&'static str], NoteRefusal)>,
}

/// Told of a refusal streak: its first refusal and this one.
type NoteRefusal = Box<dyn Fn(std::time::Instant, std::time::Instant) + Send + Sync>;

/// A refusal streak of a [`RefusalBackoff`].
#[derive(Debug, Clone, Copy)]
struct Streak {
    /// Its first refusal, ms after `origin`.
    start: u64,
    /// Its latest refusal, ms after `origin`.
    last: u64,
    /// The majority rule's windows.
    tally: Tally,
    /// The first refusal of the current run of noted ones (a noted code while refusals are
    /// at least as many as answers in the windows), ms after `origin`.
    noting_since: Option<u64>,
}

/// Refusals and answers of the current window and the one before it
/// ([`RefusalBackoff::noting`]): a window rolls at the first refusal at least a second after
/// it began, and refusals of one streak come at most [`RefusalBackoff::QUIET`] apart, so the
/// two cover the last one to four seconds.
#[derive(Debug, Clone, Copy)]
struct Tally {
    /// When the current window began, ms after `origin`.
    since: u64,
    /// Refusals in the current window.
    refused: u64,
    /// [`RefusalBackoff::answered`] when it began.
    answered_before: u64,
    /// Refusals and answers of the window before.
    previous: (u64, u64),
}

impl Tally {
    fn new(now: u64, answered: u64) -> Self {
        Self { since: now, refused: 0, answered_before: answered, previous: (0, 0) }
    }

    /// Counts a refusal at `now` (`answered`: the answers so far); returns whether refusals
    /// are at least as many as answers over the two windows.
    fn refusal(&mut self, now: u64, answered: u64) -> bool {
        if now.saturating_sub(self.since) >= 1_000 {
            let previous = (self.refused, answered.saturating_sub(self.answered_before));
            *self = Self { previous, ..Self::new(now, answered) };
        }
        self.refused += 1;
        let answers = self.previous.1 + answered.saturating_sub(self.answered_before);
        self.previous.0 + self.refused >= answers
    }
}

impl std::fmt::Debug for RefusalBackoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RefusalBackoff")
            .field("routes", &self.routes)
            .field("max_s", &self.max_s)
            .field("streak", &self.streak)
            .field("noting", &self.noted.as_ref().map(|(codes, _)| codes))
            .finish()
    }
}

impl RefusalBackoff {
    /// Time without a 503 that ends a streak.
    pub const QUIET: Duration = Duration::from_secs(2);
    /// The widest window of a streak's first second, s: the `overloaded` answer's own.
    pub const BASE_S: u64 = 3;

    /// Backoff for the route class `routes` (its label in the metric), windows capped at
    /// `max_s` seconds (at least [`Self::BASE_S`]).
    pub fn new(routes: &'static str, max_s: u64) -> Self {
        Self {
            routes,
            origin: std::time::Instant::now(),
            max_s: max_s.max(Self::BASE_S),
            streak: std::sync::Mutex::new(None),
            answered: std::sync::atomic::AtomicU64::new(0),
            noted: None,
        }
    }

    /// Tells `noted` of a run of refusals, its first and this one, at each refusal that
    /// continues the run once the streak is past its first second (when `Retry-After` is
    /// widened). A run is refusals with a problem code among `codes` while refusals are at
    /// least as many as answers ([`Self::answered`]) over the last one to four seconds
    /// ([`Tally`]); any other refusal ends it. Called on the request's task: it must be
    /// cheap and must not block.
    pub fn noting(
        mut self,
        codes: &'static [&'static str],
        noted: impl Fn(std::time::Instant, std::time::Instant) + Send + Sync + 'static,
    ) -> Self {
        self.noted = Some((codes, Box::new(noted)));
        self
    }

    /// Records an answer (a 2xx: what the caller came for).
    pub fn answered(&self) {
        self.answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Records a refusal now, with its problem `code` when it has one; returns the upper
    /// bound, seconds, of the window a refused client's `Retry-After` is drawn from, or
    /// `None` in a streak's first second.
    pub fn window_s(&self, code: Option<&str>) -> Option<u64> {
        self.refusal(None, code)
    }

    /// [`Self::window_s`] for a refusal `now` ms after the backoff was made.
    #[cfg(test)]
    fn window_s_at(&self, now: u64, code: Option<&str>) -> Option<u64> {
        self.refusal(Some(now), code)
    }

    /// A refusal at `at` ms after `origin` (now when `None`).
    fn refusal(&self, at: Option<u64>, code: Option<&str>) -> Option<u64> {
        let answered = self.answered.load(std::sync::atomic::Ordering::Relaxed);
        let noted_code = match &self.noted {
            Some((codes, _)) => code.is_some_and(|c| codes.contains(&c)),
            None => false,
        };
        let (window, streak) = {
            let mut streak = self.streak.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            // Read under the lock: refusals reach the streak in the order of their clocks.
            let now = at.unwrap_or_else(|| self.origin.elapsed().as_millis() as u64);
            (Self::advance(&mut streak, now, self.max_s, answered, noted_code), *streak)
        };
        if let (Some(_), Some(s), Some((_, noted))) = (window, streak, &self.noted) {
            if let Some(since) = s.noting_since.filter(|since| *since < s.last) {
                let at = |ms: u64| self.origin + Duration::from_millis(ms);
                noted(at(since), at(s.last));
            }
        }
        window
    }

    fn advance(
        streak: &mut Option<Streak>,
        now: u64,
        max_s: u64,
        answered: u64,
        noted_code: bool,
    ) -> Option<u64> {
        let mut s = match *streak {
            Some(s) if now.saturating_sub(s.last) <= Self::QUIET.as_millis() as u64 => s,
            _ => Streak { start: now, last: now, tally: Tally::new(now, answered), noting_since: None },
        };
        s.last = now.max(s.start);
        let refusing = s.tally.refusal(now, answered);
        s.noting_since = if noted_code && refusing { Some(s.noting_since.unwrap_or(s.last)) } else { None };
        *streak = Some(s);
        let seconds = now.saturating_sub(s.start) / 1_000;
        (seconds > 0).then(|| (Self::BASE_S << seconds.min(16)).min(max_s))
    }
}

/// Middleware (outside a route class's bulkhead, with [`RefusalBackoff`] as its state):
/// widens the `Retry-After` of each 503 as the backoff says; other answers pass untouched.
pub(crate) async fn widen_retry_after(
    axum::extract::State(backoff): axum::extract::State<Arc<RefusalBackoff>>,
    mut resp: axum::response::Response,
) -> axum::response::Response {
    if resp.status() != axum::http::StatusCode::SERVICE_UNAVAILABLE {
        // Only what a caller came for counts as answered: not the rate buckets' 429s nor a
        // 404, or a flood of them would stop a crowd's refusals from being noted.
        if resp.status().is_success() {
            backoff.answered();
        }
        return resp;
    }
    let code = resp.extensions().get::<crate::problem::ProblemCode>().map(|c| c.0);
    let Some(hi) = backoff.window_s(code) else { return resp };
    let said = resp
        .headers()
        .get(axum::http::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(1);
    let drawn = rand::Rng::gen_range(&mut rand::thread_rng(), 1..=hi);
    if drawn > said {
        resp.headers_mut().insert(axum::http::header::RETRY_AFTER, drawn.into());
        metrics::counter!("boxoffice_http_retry_after_widened_total", "routes" => backoff.routes)
            .increment(1);
    }
    resp
}

/// Serves `app` on `listener` within the bounds of `edge` until `shutdown`, then lets
/// in-flight requests finish (for at most `request_timeout`). The peer address reaches
/// handlers as `ConnectInfo<SocketAddr>`.
///
/// # Errors
/// None today: failed accepts (e.g. out of file descriptors) are logged and retried after a
/// short pause, and a failed connection only ends that connection.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    edge: EdgeSettings,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let service = ServiceBuilder::new()
        .map_response(crate::problem::ensure_problem)
        .layer(HandleErrorLayer::new(shed_process))
        .load_shed()
        .concurrency_limit(edge.max_concurrent_requests.max(1))
        .layer(TimeoutLayer::with_status_code(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            edge.request_timeout,
        ))
        .layer(RequestBodyTimeoutLayer::new(edge.body_read_timeout))
        .service(app);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(edge.header_read_timeout);
    let mut shed_http = http.clone();
    shed_http.keep_alive(false);
    let slots = Arc::new(Semaphore::new(edge.max_connections.max(1)));
    let shed_slots = Arc::new(Semaphore::new((edge.max_connections / 8).max(16)));
    let graceful = GracefulShutdown::new();
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and friends: keep serving the connections we have.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            () = shutdown.cancelled() => break,
        };
        let _ = stream.set_nodelay(true);
        let io = TokioIo::new(stream);
        let (permit, conn) = match slots.clone().try_acquire_owned() {
            Ok(p) => {
                let svc = service.clone().map_request(move |mut req: Request<Incoming>| {
                    req.extensions_mut().insert(ConnectInfo(peer));
                    req
                });
                let conn = http.serve_connection(io, TowerToHyperService::new(svc));
                (p, boxed(graceful.watch(conn)))
            }
            Err(_) => {
                let Ok(p) = shed_slots.clone().try_acquire_owned() else {
                    metrics::counter!("boxoffice_http_connections_shed_total", "how" => "closed")
                        .increment(1);
                    continue; // dropping the stream closes it
                };
                metrics::counter!("boxoffice_http_connections_shed_total", "how" => "answered_503")
                    .increment(1);
                let svc = tower::service_fn(|_req: Request<Incoming>| async {
                    Ok::<_, Infallible>(Problem::overloaded().into_response())
                });
                let conn = shed_http.serve_connection(io, TowerToHyperService::new(svc));
                (p, boxed(graceful.watch(conn)))
            }
        };
        tokio::spawn(async move {
            let _permit = permit;
            metrics::gauge!("boxoffice_http_connections").increment(1.0);
            if let Err(e) = conn.await {
                if e.is_timeout() {
                    metrics::counter!("boxoffice_http_header_timeouts_total").increment(1);
                }
                tracing::debug!(error = %e, "connection ended with an error");
            }
            metrics::gauge!("boxoffice_http_connections").decrement(1.0);
        });
    }
    drop(listener);
    if tokio::time::timeout(edge.request_timeout, graceful.shutdown()).await.is_err() {
        tracing::warn!("connections still open after the shutdown grace period; closing them");
    }
    Ok(())
}

type ConnFuture = std::pin::Pin<Box<dyn std::future::Future<Output = hyper::Result<()>> + Send>>;

fn boxed(f: impl std::future::Future<Output = hyper::Result<()>> + Send + 'static) -> ConnFuture {
    Box::pin(f)
}

/// At most `max` requests in flight per client address (by [`bucket_key`], from
/// [`client_ip`]); see the module doc. 0 turns it off. Metrics:
/// `boxoffice_http_in_flight_refused_total{class}`.
#[derive(Debug)]
pub struct PerClientInFlight {
    class: &'static str,
    max: usize,
    trusted_proxy_hops: u32,
    counts: std::sync::Mutex<std::collections::HashMap<String, usize>>,
}

/// One request's place in a [`PerClientInFlight`]; dropping it frees the place.
#[derive(Debug)]
pub struct InFlightPlace {
    owner: Arc<PerClientInFlight>,
    key: String,
}

impl PerClientInFlight {
    /// A limit of `max` per client for route class `class` (a metrics label), the client as
    /// [`client_ip`] finds it with `trusted_proxy_hops`.
    pub fn new(class: &'static str, max: usize, trusted_proxy_hops: u32) -> Arc<Self> {
        Arc::new(Self { class, max, trusted_proxy_hops, counts: Default::default() })
    }

    /// A place for `key`, or `None` when it already has `max` requests in flight.
    pub fn enter(self: &Arc<Self>, key: String) -> Option<InFlightPlace> {
        let mut counts = self.counts.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = counts.entry(key.clone()).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        Some(InFlightPlace { owner: self.clone(), key })
    }

    /// The limit per client (0: none).
    pub fn max(&self) -> usize {
        self.max
    }

    /// The key a request from `peer` with `headers` is counted under: its client address
    /// ([`client_ip`] with this limit's trusted proxy hops), grouped by [`bucket_key`];
    /// `None` when the address is unknown.
    pub fn client_key(&self, peer: Option<IpAddr>, headers: &HeaderMap) -> Option<String> {
        client_ip(peer, headers, self.trusted_proxy_hops).map(bucket_key)
    }

    /// Requests `key` has in flight now.
    pub fn in_flight(&self, key: &str) -> usize {
        self.counts.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(key).copied().unwrap_or(0)
    }
}

impl Drop for InFlightPlace {
    fn drop(&mut self) {
        let mut counts = self.owner.counts.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = counts.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.key);
            }
        }
    }
}

/// Middleware of a [`PerClientInFlight`] (`axum::middleware::from_fn_with_state`): over the
/// client's limit → 429 `too_many_in_flight` with `Retry-After`, before the handler reads
/// anything; a request whose client address is unknown passes.
pub async fn limit_in_flight(
    axum::extract::State(limit): axum::extract::State<Arc<PerClientInFlight>>,
    req: Request<axum::body::Body>,
    next: axum::middleware::Next,
) -> axum::response::Response {
    if limit.max == 0 {
        return next.run(req).await;
    }
    let peer = req.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0.ip());
    let Some(key) = limit.client_key(peer, req.headers()) else {
        return next.run(req).await;
    };
    match limit.enter(key) {
        Some(place) => {
            let resp = next.run(req).await;
            drop(place);
            resp
        }
        None => {
            metrics::counter!("boxoffice_http_in_flight_refused_total", "class" => limit.class).increment(1);
            Problem::too_many_in_flight(limit.max).into_response()
        }
    }
}

/// Where webhooks may come from (`webhook_allowed_networks`; empty: anywhere), judged by the
/// client's address ([`client_ip`] of `peer` and `headers` with `trusted_proxy_hops`): `None`
/// when the request may go on, else the 403 `webhook_source_refused` to answer before its
/// body is read. The API's webhook ingress and the cell router take it from here, so a
/// router in front of the cells refuses what each cell would. Counted as
/// `boxoffice_stripe_webhooks_total{outcome="source_refused"}`.
pub fn webhook_source_refusal(
    allowed: &[ipnet::IpNet],
    peer: Option<IpAddr>,
    headers: &HeaderMap,
    trusted_proxy_hops: u32,
) -> Option<Problem> {
    if allowed.is_empty() {
        return None;
    }
    let ip = client_ip(peer, headers, trusted_proxy_hops);
    if ip.is_some_and(|ip| allowed.iter().any(|n| n.contains(&ip.to_canonical()))) {
        return None;
    }
    metrics::counter!("boxoffice_stripe_webhooks_total", "outcome" => "source_refused").increment(1);
    Some(Problem::new(
        axum::http::StatusCode::FORBIDDEN,
        "webhook_source_refused",
        "Webhook source refused",
        "webhooks are accepted only from the provider's published addresses",
    ))
}

/// The address a request is counted against: the socket's `peer`, or, with
/// `trusted_proxy_hops` = N > 0 (N proxies of this deployment in front of it, each appending
/// the address it saw to `X-Forwarded-For`), the N-th entry from the right — the address the
/// outermost trusted proxy saw. Entries left of it were written by the client and are
/// ignored. With fewer than N entries the leftmost one is taken (every entry then came from
/// a trusted proxy). An entry that is not an IP address (optionally with a port, IPv6 in
/// brackets) yields `peer`, as does a missing header; 0 hops ignores the header.
pub fn client_ip(peer: Option<IpAddr>, headers: &HeaderMap, trusted_proxy_hops: u32) -> Option<IpAddr> {
    if trusted_proxy_hops == 0 {
        return peer;
    }
    let lines = forwarded_for_lines(headers);
    let entries: Vec<&str> =
        lines.iter().flat_map(|v| v.split(',')).map(str::trim).filter(|s| !s.is_empty()).collect();
    let hops = trusted_proxy_hops as usize;
    let Some(entry) = entries.get(entries.len().saturating_sub(hops)) else {
        return peer;
    };
    parse_forwarded(entry).or(peer)
}

/// The `X-Forwarded-For` header lines of `headers`, in order, each byte that is not visible
/// ASCII (or a space or tab) replaced by `?`. A client's unreadable entry stays an entry that
/// is no address, so it cannot drop the line it shares with a trusted proxy's entry and shift
/// which entry is counted from the right.
pub fn forwarded_for_lines(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all("x-forwarded-for")
        .iter()
        .map(|v| {
            v.as_bytes()
                .iter()
                .map(|&b| if b == b'\t' || (0x20..0x7f).contains(&b) { b as char } else { '?' })
                .collect()
        })
        .collect()
}

/// `203.0.113.7`, `203.0.113.7:4711`, `2001:db8::1` or `[2001:db8::1]:443`.
fn parse_forwarded(entry: &str) -> Option<IpAddr> {
    entry
        .parse::<IpAddr>()
        .ok()
        .or_else(|| entry.parse::<SocketAddr>().ok().map(|s| s.ip()))
        .or_else(|| entry.strip_prefix('[')?.strip_suffix(']')?.parse().ok())
}

/// The rate-bucket key of `ip`: an IPv4 address as is (IPv4-mapped IPv6 included), an IPv6
/// address by its /64 (`2001:db8:1:2::/64`): one subscriber usually gets a whole /64, so
/// keying by full address would give each client 2^64 buckets.
pub fn bucket_key(ip: IpAddr) -> String {
    match ip.to_canonical() {
        IpAddr::V4(a) => a.to_string(),
        IpAddr::V6(a) => {
            let s = a.segments();
            let prefix = std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0);
            format!("{prefix}/64")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn xff(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("x-forwarded-for", HeaderValue::from_str(v).unwrap());
        }
        h
    }

    const PEER: Option<IpAddr> = Some(IpAddr::V4(std::net::Ipv4Addr::new(192, 0, 2, 1)));

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    #[test]
    fn zero_hops_ignores_the_header() {
        assert_eq!(client_ip(PEER, &xff(&["203.0.113.7"]), 0), PEER);
    }

    #[test]
    fn one_hop_takes_the_entry_the_proxy_appended() {
        // The client forged the first entry; the proxy appended what it saw.
        assert_eq!(client_ip(PEER, &xff(&["1.2.3.4, 203.0.113.7"]), 1), ip("203.0.113.7"));
        // Entries spread over several header lines count in order.
        assert_eq!(client_ip(PEER, &xff(&["1.2.3.4", "203.0.113.7"]), 1), ip("203.0.113.7"));
    }

    #[test]
    fn n_hops_take_the_nth_entry_from_the_right() {
        let h = xff(&["6.6.6.6, 203.0.113.7, 198.51.100.2"]);
        assert_eq!(client_ip(PEER, &h, 2), ip("203.0.113.7"));
        assert_eq!(client_ip(PEER, &h, 3), ip("6.6.6.6"));
        // Fewer entries than hops: the leftmost (all of them came from trusted proxies).
        assert_eq!(client_ip(PEER, &xff(&["203.0.113.7"]), 3), ip("203.0.113.7"));
    }

    #[test]
    fn an_unreadable_client_entry_keeps_the_proxys_entry_in_place() {
        // nginx appends to the client's own line: a byte above 0x7f in the client's part must
        // not drop the proxy's entry with it.
        let mut h = HeaderMap::new();
        h.append("x-forwarded-for", HeaderValue::from_bytes(b"1.2.3.4\xff, 203.0.113.7").unwrap());
        assert_eq!(client_ip(PEER, &h, 1), ip("203.0.113.7"));
        assert_eq!(forwarded_for_lines(&h), vec!["1.2.3.4?, 203.0.113.7".to_owned()]);
    }

    #[test]
    fn garbage_or_missing_entries_fall_back_to_the_socket() {
        assert_eq!(client_ip(PEER, &HeaderMap::new(), 1), PEER);
        assert_eq!(client_ip(PEER, &xff(&[""]), 1), PEER);
        assert_eq!(client_ip(PEER, &xff(&[" , "]), 1), PEER);
        assert_eq!(client_ip(PEER, &xff(&["1.2.3.4, not-an-ip"]), 1), PEER);
        assert_eq!(client_ip(PEER, &xff(&["1.2.3.4, 999.1.1.1"]), 1), PEER);
        assert_eq!(client_ip(PEER, &xff(&["1.2.3.4, unknown"]), 1), PEER);
        assert_eq!(client_ip(None, &xff(&["junk"]), 1), None);
    }

    #[test]
    fn entries_with_ports_and_brackets_parse() {
        assert_eq!(client_ip(PEER, &xff(&["203.0.113.7:4711"]), 1), ip("203.0.113.7"));
        assert_eq!(client_ip(PEER, &xff(&["[2001:db8::1]:443"]), 1), ip("2001:db8::1"));
        assert_eq!(client_ip(PEER, &xff(&["[2001:db8::1]"]), 1), ip("2001:db8::1"));
        assert_eq!(client_ip(PEER, &xff(&["2001:db8::1"]), 1), ip("2001:db8::1"));
    }

    /// One semaphore for every route and method behind a bulkhead: with its slots taken by
    /// requests that wait, the next one — another method, another route — is shed at once
    /// with 503 `overloaded` problem+json; routes outside it are untouched; and the slots come
    /// back when the waiting requests end.
    #[tokio::test]
    async fn a_bulkhead_sheds_at_once_across_its_routes_and_methods() {
        use axum::http::{header, StatusCode};
        use axum::routing::get;
        let gate = Arc::new(Semaphore::new(0));
        let (entered_tx, mut entered) = tokio::sync::mpsc::unbounded_channel::<()>();
        let handler_gate = gate.clone();
        let wait = move || {
            let (gate, entered_tx) = (handler_gate.clone(), entered_tx.clone());
            async move {
                let _ = entered_tx.send(());
                let _ = gate.acquire().await.map(|p| p.forget());
                "done"
            }
        };
        let app = Router::new()
            .route("/a", get(wait.clone()).post(wait.clone()))
            .route("/b", get(wait))
            .route_layer(bulkhead("test", 2))
            .route("/outside", get(|| async { "ok" }));
        let call = |method: &str, path: &str| {
            let req =
                axum::extract::Request::builder().method(method).uri(path).body(axum::body::Body::empty());
            app.clone().oneshot(req.unwrap())
        };
        let first = tokio::spawn(call("GET", "/a"));
        let second = tokio::spawn(call("POST", "/a"));
        for _ in 0..2 {
            tokio::time::timeout(Duration::from_secs(5), entered.recv())
                .await
                .expect("both reach the handler");
        }
        for (method, path) in [("GET", "/b"), ("POST", "/a"), ("GET", "/a")] {
            let r = tokio::time::timeout(Duration::from_secs(1), call(method, path))
                .await
                .expect("shed at once, not queued")
                .unwrap();
            assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE, "{method} {path}");
            assert_eq!(r.headers()[header::CONTENT_TYPE], "application/problem+json");
            assert!(r.headers().contains_key(header::RETRY_AFTER));
            let body = axum::body::to_bytes(r.into_body(), 64 * 1024).await.unwrap();
            let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(problem["code"], "overloaded", "{problem}");
        }
        assert!(entered.try_recv().is_err(), "no shed request reached the handler");
        let outside = call("GET", "/outside").await.unwrap();
        assert_eq!(outside.status(), StatusCode::OK, "a route outside the bulkhead is not shed");
        gate.add_permits(2);
        assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::OK);
        assert_eq!(second.await.unwrap().unwrap().status(), StatusCode::OK);
        gate.add_permits(1);
        assert_eq!(call("GET", "/b").await.unwrap().status(), StatusCode::OK, "its slots came back");
    }

    /// A streak's first second is left alone; then the window doubles each second up to the
    /// cap; a quiet spell longer than `QUIET` starts a new streak.
    #[test]
    fn refusals_that_keep_coming_widen_the_window_up_to_its_cap() {
        let b = RefusalBackoff::new("test", 20);
        assert_eq!(b.window_s_at(10_000, Some("overloaded")), None, "a streak's first refusal");
        assert_eq!(b.window_s_at(10_900, Some("overloaded")), None, "its first second");
        assert_eq!(b.window_s_at(11_000, Some("overloaded")), Some(6));
        assert_eq!(b.window_s_at(12_500, Some("overloaded")), Some(12));
        assert_eq!(b.window_s_at(13_000, Some("overloaded")), Some(20), "24 capped at 20");
        assert_eq!(b.window_s_at(40_000, Some("overloaded")), None, "quiet for 27 s: a new streak");
        assert_eq!(b.window_s_at(41_000, Some("overloaded")), Some(6));
        assert_eq!(b.window_s_at(43_001, Some("overloaded")), None, "quiet for just over QUIET");
        let low = RefusalBackoff::new("test", 1);
        assert_eq!(low.window_s_at(0, Some("overloaded")), None);
        assert_eq!(
            low.window_s_at(1_500, Some("overloaded")),
            Some(RefusalBackoff::BASE_S),
            "the cap is at least the base"
        );
        let long = RefusalBackoff::new("test", u64::MAX);
        long.window_s_at(0, Some("overloaded"));
        for t in (1_000..600_000).step_by(1_000) {
            assert!(long.window_s_at(t, Some("overloaded")).is_some(), "no overflow at {t} ms");
        }
    }

    #[test]
    fn a_streak_past_its_first_second_is_noted_for_the_lapse_clock() {
        let noted = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = noted.clone();
        let b = RefusalBackoff::new("test", 20)
            .noting(&["overloaded"], move |from, to| sink.lock().unwrap().push((from, to)));
        let at = |ms: u64| b.origin + Duration::from_millis(ms);
        let refused = Some("overloaded");
        b.window_s_at(10_000, refused);
        b.window_s_at(10_900, refused);
        assert!(noted.lock().unwrap().is_empty(), "a streak's first second is not noted");
        b.window_s_at(11_500, refused);
        b.window_s_at(13_000, refused);
        assert_eq!(*noted.lock().unwrap(), vec![(at(10_000), at(11_500)), (at(10_000), at(13_000))]);
        b.window_s_at(13_500, Some("unavailable")); // ends the run of noted refusals
        b.window_s_at(13_600, None);
        assert_eq!(noted.lock().unwrap().len(), 2, "only the codes it was given are noted");
        b.window_s_at(15_000, refused); // the same streak (within QUIET), a new run
        assert_eq!(noted.lock().unwrap().len(), 2);
        b.window_s_at(15_400, refused);
        assert_eq!(noted.lock().unwrap().last(), Some(&(at(15_000), at(15_400))), "from the run's start");
        // Answers outnumbering the refusals in the window: widened on, but not noted.
        for _ in 0..10 {
            b.answered();
        }
        assert!(b.window_s_at(15_800, refused).is_some(), "still widened");
        assert_eq!(noted.lock().unwrap().len(), 3, "3 refusals against 10 answers");
        // The answers leave the windows once they have rolled past them twice.
        b.window_s_at(17_000, refused);
        assert_eq!(noted.lock().unwrap().len(), 3, "the answers are in the window before");
        b.window_s_at(18_100, refused);
        b.window_s_at(18_500, refused);
        assert_eq!(noted.lock().unwrap().last(), Some(&(at(18_100), at(18_500))), "a new run");
        // After a quiet spell: a new streak, counted from its own start.
        b.window_s_at(21_000, refused);
        assert_eq!(noted.lock().unwrap().len(), 4, "its first second");
        b.window_s_at(22_100, refused);
        assert_eq!(noted.lock().unwrap().last(), Some(&(at(21_000), at(22_100))));
    }

    /// Behind [`widen_retry_after`]: 503s in a streak's first second and every other answer
    /// pass untouched; 503s of a streak older than that get `Retry-After` drawn up to the cap,
    /// never shorter than the answer's own, and never past the cap.
    #[tokio::test]
    async fn a_crowd_refused_for_seconds_is_told_to_come_back_later() {
        use axum::http::{header, StatusCode};
        use axum::routing::get;
        // Made a minute ago, so that a streak can be dated back below.
        let minute_ago = std::time::Instant::now() - Duration::from_secs(60);
        let backoff = Arc::new(RefusalBackoff { origin: minute_ago, ..RefusalBackoff::new("test", 20) });
        let app = Router::new()
            .route(
                "/refused",
                get(|| async { (StatusCode::SERVICE_UNAVAILABLE, [(header::RETRY_AFTER, "2")], "busy") }),
            )
            .route("/ok", get(|| async { "ok" }))
            .route_layer(axum::middleware::map_response_with_state(backoff.clone(), widen_retry_after));
        let retry_after = |path: &'static str| {
            let app = app.clone();
            async move {
                let req =
                    axum::extract::Request::builder().uri(path).body(axum::body::Body::empty()).unwrap();
                let r = app.oneshot(req).await.unwrap();
                let secs =
                    r.headers().get(header::RETRY_AFTER).map(|v| v.to_str().unwrap().parse::<u64>().unwrap());
                (r.status(), secs)
            }
        };
        for _ in 0..50 {
            assert_eq!(
                retry_after("/refused").await,
                (StatusCode::SERVICE_UNAVAILABLE, Some(2)),
                "first second"
            );
        }
        // A streak that began 10 s ago, its last refusal half a second ago.
        let now = backoff.origin.elapsed().as_millis() as u64;
        *backoff.streak.lock().unwrap() = Some(Streak {
            start: now - 10_000,
            last: now - 500,
            tally: Tally::new(now - 500, 0),
            noting_since: None,
        });
        let mut seen = Vec::new();
        for _ in 0..200 {
            let (status, secs) = retry_after("/refused").await;
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
            seen.push(secs.expect("a Retry-After"));
        }
        assert!(seen.iter().all(|s| (2..=20).contains(s)), "between the answer's own and the cap: {seen:?}");
        assert!(seen.iter().any(|&s| s > 10), "spread toward the cap: {seen:?}");
        assert_eq!(retry_after("/ok").await, (StatusCode::OK, None), "other answers untouched");
    }

    #[test]
    fn ipv6_clients_are_keyed_by_their_64() {
        let a = bucket_key("2001:db8:1:2:aaaa::1".parse().unwrap());
        let b = bucket_key("2001:db8:1:2:ffff:1:2:3".parse().unwrap());
        let other = bucket_key("2001:db8:1:3::1".parse().unwrap());
        assert_eq!(a, "2001:db8:1:2::/64");
        assert_eq!(a, b, "one /64, one bucket");
        assert_ne!(a, other);
        assert_eq!(bucket_key("203.0.113.7".parse().unwrap()), "203.0.113.7");
        assert_eq!(bucket_key("::ffff:203.0.113.7".parse().unwrap()), "203.0.113.7", "IPv4-mapped is IPv4");
    }
}
