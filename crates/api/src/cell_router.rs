//! The router role (design §13): one HTTP entry point in front of every purchase cell's API.
//! It sends each buyer to the cell that sells the event, from a cached copy of the event
//! directory ([`boxoffice_store::directory`]) re-read every `refresh` and kept as it was while
//! the control database is down, so a control-database outage never stops a sale.
//!
//! What it routes, and by what:
//! - `/events/{event_id}/…` (waiting room, admission, holds, seat map): the directory's cell.
//!   An event missing from the map is 404 while the map is fresh, and 503
//!   `directory_unavailable` while the last read failed (the event may be newer than the map).
//! - `/queue/{ticket}`, `/orders/{order_id}[/…]`: an order or a queue ticket lives in one cell
//!   for good ("an order never leaves its cell"), so the first lookup asks every cell at once:
//!   the first success names the cell (the id → cell pair is then cached); without one, a
//!   cell's other answer (a 429 or a 503 of a cell that may not own it) is relayed, and a 404
//!   only when every cell said so.
//! - `POST /webhooks/stripe`: the cell named in the object's `metadata.purchase_cell` (the
//!   payment worker writes it on every PaymentIntent). Without one the answer is 503, which
//!   Stripe retries, and it is logged: an event no cell can claim is never dropped here.
//!   A sender outside `webhook_allowed_networks` is refused (403 `webhook_source_refused`)
//!   before its body is read, as each cell would refuse it.
//!
//! Paths with dot segments or percent-encoded separators are refused (400 `invalid_path`), so
//! what is forwarded is exactly what was routed, and only reads (and a queue leave) are asked
//! of every cell. Each client address may have `http_max_in_flight_per_ip` requests in flight
//! until their answers' heads; order streams, which last, have bounds of their own below.
//!
//! It decides nothing: the cell's hold transaction checks that it sells the event at the
//! admission token's directory epoch, so a stale map costs a buyer a 409 and a new
//! admission, never a seat sold twice. The router appends the peer to `X-Forwarded-For`
//! (cells behind it count buyers with `http_trusted_proxy_hops` one more than the router's
//! own) and reads each answer whole within a bounded timeout; its own socket is bounded by the
//! same edge as the API's.
//!
//! A buyer's order stream (`GET /orders/{order_id}/events`, `text/event-stream`) is the
//! exception: its head comes within that timeout, then its events are passed on as the cell
//! sends them, and the stream is cut when the cell sends nothing (not even its heartbeat) for
//! the stream's idle bound. A stream holds a client connection and a cell connection for its
//! whole life, so the router admits at most [`StreamBounds::max`] at once and
//! [`StreamBounds::max_per_ip`] per client address (429 `too_many_streams`), which keeps the
//! router's connections for holds and webhooks as the cells' own bounds keep theirs. A stream
//! of an order the router has not located yet first finds its cell with the order's plain
//! read (`GET /orders/{order_id}`, asked of every cell), so a cell that does not own the order
//! and refuses the stream (it is full) never answers for the one that does.

use crate::problem::Problem;
use axum::body::Body;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, HeaderName, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use bytes::Bytes;
use serde_json::json;
use sqlx::PgPool;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Largest request body forwarded, bytes (a hold body or a webhook is a few KB).
pub const MAX_FORWARDED_BODY: usize = 256 * 1024;

/// The directory as last read: event → (cell, directory epoch).
#[derive(Debug, Clone, Default)]
pub struct DirectoryMap {
    /// The entries.
    pub events: HashMap<Uuid, (String, i64)>,
    /// When it was read (`None`: never).
    pub read_at: Option<Instant>,
    /// Whether the last attempt to re-read it failed.
    pub stale: bool,
}

/// The router's state.
#[derive(Clone)]
pub struct CellRouter {
    map: Arc<RwLock<DirectoryMap>>,
    cells: Arc<HashMap<String, String>>,
    located: moka::future::Cache<Uuid, String>,
    http: reqwest::Client,
    /// For order streams: no bound on the whole answer, [`StreamBounds::idle`] between two
    /// reads.
    streams: reqwest::Client,
    timeout: Duration,
    stream_slots: Arc<tokio::sync::Semaphore>,
    stream_max: usize,
    streams_per_ip: Arc<crate::edge::PerClientInFlight>,
    /// Where webhooks may come from ([`CellRouter::with_webhook_networks`]; empty: anywhere).
    webhook_networks: Arc<[ipnet::IpNet]>,
    /// Proxies in front of the router ([`StreamBounds::trusted_proxy_hops`]).
    trusted_proxy_hops: u32,
}

/// The router's bounds on the order streams it relays.
#[derive(Debug, Clone, Copy)]
pub struct StreamBounds {
    /// Longest silence of the cell within a stream (give it a few of the cells'
    /// `order_stream_heartbeat_s`); past it the stream is cut and the client reconnects.
    pub idle: Duration,
    /// Streams relayed at once (≥ 1); more get 429 `too_many_streams` (`scope` `process`).
    /// At most half of the router's `http_max_connections`, as on a cell.
    pub max: usize,
    /// Streams one client address may have open (0: no bound); more get 429
    /// `too_many_streams` (`scope` `ip`).
    pub max_per_ip: usize,
    /// Proxies of the deployment in front of the router, for the client's address
    /// ([`crate::edge::client_ip`]).
    pub trusted_proxy_hops: u32,
}

/// A relayed stream's places in the router's bounds, freed when the stream ends.
struct StreamPlaces {
    _process: tokio::sync::OwnedSemaphorePermit,
    _ip: Option<crate::edge::InFlightPlace>,
}

/// What asking every cell about an id found.
enum Found {
    /// The cell that answered with a success, and its answer.
    Owner(String, reqwest::Response),
    /// No owner: a cell's other answer (not 404), or a 404 when every cell said so.
    Answer(reqwest::Response),
}

impl CellRouter {
    /// A router forwarding to `cells` (cell name → API base URL), with `timeout` per
    /// forwarded request: for the whole answer, or, for an order stream, until its head; then
    /// `streams` bounds it.
    ///
    /// # Errors
    /// When an HTTP client cannot be built.
    pub fn new(
        cells: HashMap<String, String>,
        timeout: Duration,
        streams: StreamBounds,
    ) -> Result<Self, reqwest::Error> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(Duration::from_secs(2))
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        let stream_client = reqwest::Client::builder()
            .read_timeout(streams.idle)
            .connect_timeout(Duration::from_secs(2))
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        Ok(Self {
            map: Arc::default(),
            cells: Arc::new(
                cells.into_iter().map(|(k, v)| (k, v.trim_end_matches('/').to_owned())).collect(),
            ),
            located: moka::future::Cache::builder().max_capacity(1_000_000).build(),
            http,
            streams: stream_client,
            timeout,
            stream_slots: Arc::new(tokio::sync::Semaphore::new(streams.max.max(1))),
            stream_max: streams.max.max(1),
            streams_per_ip: crate::edge::PerClientInFlight::new(
                "router_streams",
                streams.max_per_ip,
                streams.trusted_proxy_hops,
            ),
            webhook_networks: Arc::new([]),
            trusted_proxy_hops: streams.trusted_proxy_hops,
        })
    }

    /// Webhooks only from `networks` (the deployment's `webhook_allowed_networks`, as every
    /// cell has): others get 403 `webhook_source_refused` here, before their body is read
    /// ([`crate::edge::webhook_source_refusal`]), so no sender outside them holds the router's
    /// connections or a cell's. Empty: from anywhere (development).
    pub fn with_webhook_networks(mut self, networks: Vec<ipnet::IpNet>) -> Self {
        self.webhook_networks = networks.into();
        self
    }

    /// The map as last read.
    pub fn map(&self) -> DirectoryMap {
        self.map.read().expect("directory map poisoned").clone()
    }

    /// Re-reads the directory once: replaces the map, or keeps it and marks it stale.
    pub async fn refresh(&self, control: &PgPool) -> bool {
        let read =
            tokio::time::timeout(Duration::from_secs(2), boxoffice_store::directory::list(control)).await;
        let mut map = self.map.write().expect("directory map poisoned");
        match read {
            Ok(Ok(entries)) => {
                map.events = entries.into_iter().map(|e| (e.event_id, (e.cell, e.directory_epoch))).collect();
                map.read_at = Some(Instant::now());
                map.stale = false;
                true
            }
            Ok(Err(_)) | Err(_) => {
                map.stale = true;
                false
            }
        }
    }

    /// Re-reads the directory every `every` until `shutdown`, logging a change of health once.
    pub async fn run_refresh(self, control: PgPool, every: Duration, shutdown: CancellationToken) {
        let mut healthy = true;
        loop {
            let ok = self.refresh(&control).await;
            if ok != healthy {
                if ok {
                    tracing::info!("event directory readable again");
                } else {
                    tracing::warn!("event directory unreadable: routing with the last map read");
                }
                healthy = ok;
            }
            let age = self.map().read_at.map_or(f64::INFINITY, |t| t.elapsed().as_secs_f64());
            metrics::gauge!("boxoffice_router_directory_age_seconds").set(age);
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
        }
    }

    fn base(&self, cell: &str) -> Result<&str, Problem> {
        self.cells.get(cell).map(String::as_str).ok_or_else(|| {
            tracing::error!(cell, "the directory names a cell this router has no api_url for");
            Problem::new(
                StatusCode::BAD_GATEWAY,
                "cell_unknown",
                "Unknown purchase cell",
                "the event's cell is not reachable from here",
            )
        })
    }
}

/// The router's HTTP application: every path goes through [`route`].
///
/// Every request is behind a limit of `max_in_flight_per_ip` requests in flight per client
/// address until its answer's head (as the cells' buyer routes; `trusted_proxy_hops` says
/// which `X-Forwarded-For` entry is the client; 0 turns it off), so one client's slow bodies
/// cannot take the slots every cell's buyers share; order streams, which outlast their head,
/// are bounded by [`StreamBounds`].
///
/// The router's own routes: `GET /healthz` (liveness), `GET /metrics` (its Prometheus page:
/// `boxoffice_router_directory_age_seconds`, `boxoffice_router_upstream_errors_total{cell}`,
/// `boxoffice_router_streams_refused_total{scope}`,
/// `boxoffice_stripe_webhooks_total{outcome="source_refused"}`)
/// and `GET /routerz` (the map's size and staleness).
pub fn app(
    router: CellRouter,
    max_in_flight_per_ip: usize,
    trusted_proxy_hops: u32,
    metrics: Option<metrics_exporter_prometheus::PrometheusHandle>,
) -> Router {
    let limit = crate::edge::PerClientInFlight::new("router", max_in_flight_per_ip, trusted_proxy_hops);
    let page = move || {
        let metrics = metrics.clone();
        async move {
            match metrics {
                Some(h) => ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], h.render())
                    .into_response(),
                None => Problem::not_found("metrics").into_response(),
            }
        }
    };
    Router::new()
        .route("/healthz", axum::routing::get(|| async { "ok" }))
        .route("/metrics", axum::routing::get(page))
        .fallback(route)
        .with_state(router)
        .layer(axum::middleware::from_fn_with_state(limit, crate::edge::limit_in_flight))
}

/// Whether `path` routes as it reads: no `.`/`..` segment and no percent-encoded dot, slash or
/// backslash anywhere. An HTTP client resolves dot segments before sending, so a path such as
/// `/orders/{id}/../../events/E/holds` would be routed as an order lookup and arrive at every
/// cell as a hold; such paths are refused instead.
fn plain_path(path: &str) -> bool {
    let lower = path.to_ascii_lowercase();
    !lower.contains("%2e")
        && !lower.contains("%2f")
        && !lower.contains("%5c")
        && !path.contains('\\')
        && path.split('/').all(|seg| seg != "." && seg != "..")
}

/// Where a request goes.
enum Target {
    Cell(String),
    Locate(Uuid),
    Webhook,
    Status,
}

fn target(router: &CellRouter, method: &Method, path: &str) -> Result<Target, Problem> {
    if !plain_path(path) {
        return Err(Problem::bad_request("invalid_path", "the path has dot segments or encoded separators"));
    }
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match parts.as_slice() {
        ["routerz"] => Ok(Target::Status),
        ["webhooks", "stripe"] => Ok(Target::Webhook),
        ["events", id, ..] => {
            let id: Uuid =
                id.parse().map_err(|_| Problem::bad_request("invalid_path", "the event id is not a UUID"))?;
            let map = router.map.read().expect("directory map poisoned");
            match map.events.get(&id) {
                Some((cell, _)) => Ok(Target::Cell(cell.clone())),
                None if map.stale || map.read_at.is_none() => Err(directory_unavailable()),
                None => Err(Problem::not_found("event")),
            }
        }
        ["orders", id, ..] | ["queue", id] => {
            let id: Uuid =
                id.parse().map_err(|_| Problem::bad_request("invalid_path", "the id is not a UUID"))?;
            // Only reads and a queue leave are asked of every cell: nothing that writes.
            if !matches!(*method, Method::GET | Method::HEAD | Method::DELETE) {
                return Err(Problem::new(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "method_not_allowed",
                    "Method not allowed",
                    "orders and queue tickets are read (or a ticket left) here",
                ));
            }
            Ok(Target::Locate(id))
        }
        _ => Err(Problem::not_found("route")),
    }
}

fn directory_unavailable() -> Problem {
    let mut p = Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "directory_unavailable",
        "Event directory unavailable",
        "the event is not in the last directory read and the directory cannot be read now",
    );
    p.retry_after = Some(2);
    p
}

async fn route(
    State(router): State<CellRouter>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    req: Request<Body>,
) -> Result<Response, Problem> {
    let (parts, body) = req.into_parts();
    let path_and_query = parts.uri.path_and_query().map_or("/", |p| p.as_str()).to_owned();
    let target = target(&router, &parts.method, parts.uri.path())?;
    if matches!(target, Target::Webhook) {
        if let Some(refused) = crate::edge::webhook_source_refusal(
            &router.webhook_networks,
            Some(peer.ip()),
            &parts.headers,
            router.trusted_proxy_hops,
        ) {
            return Err(refused);
        }
    }
    let body = axum::body::to_bytes(body, MAX_FORWARDED_BODY).await.map_err(|_| {
        Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            "Body too large",
            "the request body is too large",
        )
    })?;
    let stream = order_stream(&parts.method, parts.uri.path());
    let fwd = Forward { method: parts.method, path_and_query, headers: parts.headers, body, peer, stream };
    match target {
        Target::Status => {
            let map = router.map();
            Ok(axum::Json(json!({
                "events": map.events.len(),
                "stale": map.stale,
                "age_s": map.read_at.map(|t| t.elapsed().as_secs_f64()),
            }))
            .into_response())
        }
        Target::Cell(cell) => router.forward(&cell, &fwd).await,
        Target::Webhook => {
            let cell = serde_json::from_slice::<serde_json::Value>(&fwd.body)
                .ok()
                .and_then(|v| v.pointer("/data/object/metadata/purchase_cell")?.as_str().map(str::to_owned));
            match cell {
                Some(cell) if router.cells.contains_key(&cell) => router.forward(&cell, &fwd).await,
                Some(_) => {
                    // Forged, or a cell this router was not told about: the provider retries.
                    tracing::warn!("a webhook names a purchase cell this router does not know");
                    let mut p = Problem::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "webhook_cell_unknown",
                        "Unknown purchase cell",
                        "the event's object names a purchase cell this router does not serve",
                    );
                    p.retry_after = Some(60);
                    Err(p)
                }
                None => {
                    tracing::warn!(
                        "a webhook names no purchase cell; answered 503 for the provider to retry"
                    );
                    let mut p = Problem::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "webhook_cell_unknown",
                        "No purchase cell",
                        "the event's object names no purchase cell",
                    );
                    p.retry_after = Some(60);
                    Err(p)
                }
            }
        }
        Target::Locate(id) if fwd.stream => {
            let places = router.admit_stream(peer, &fwd.headers)?;
            let cell = match router.located.get(&id).await {
                Some(cell) => cell,
                None => match router.find(id, &fwd.order_read(id)).await? {
                    Found::Owner(cell, read) => {
                        // Read to its end, so the connection is reused.
                        let _ = read.bytes().await;
                        cell
                    }
                    Found::Answer(r) => return relay(r, None).await,
                },
            };
            relay(router.send(&cell, &fwd).await?, Some(places)).await
        }
        Target::Locate(id) => match router.located.get(&id).await {
            Some(cell) => router.forward(&cell, &fwd).await,
            None => match router.find(id, &fwd).await? {
                Found::Owner(_, r) | Found::Answer(r) => relay(r, None).await,
            },
        },
    }
}

/// A request to forward.
struct Forward {
    method: Method,
    path_and_query: String,
    headers: HeaderMap,
    body: Bytes,
    peer: SocketAddr,
    /// A buyer's order stream ([`order_stream`]).
    stream: bool,
}

impl Forward {
    /// The plain read of order `id` (`GET /orders/{id}`) with this request's headers: how a
    /// stream's order is located.
    fn order_read(&self, id: Uuid) -> Forward {
        Forward {
            method: Method::GET,
            path_and_query: format!("/orders/{id}"),
            headers: self.headers.clone(),
            body: Bytes::new(),
            peer: self.peer,
            stream: false,
        }
    }
}

/// Whether a request asks for a buyer's order stream, `GET` (or `HEAD`)
/// `/orders/{order_id}/events`: its answer is relayed as it comes ([`relay`]).
fn order_stream(method: &Method, path: &str) -> bool {
    matches!(*method, Method::GET | Method::HEAD)
        && matches!(
            path.trim_start_matches('/').split('/').collect::<Vec<_>>().as_slice(),
            ["orders", _, "events"]
        )
}

/// Headers that belong to one hop (RFC 9110 §7.6.1) or that the client must not set.
fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

impl CellRouter {
    async fn send(&self, cell: &str, f: &Forward) -> Result<reqwest::Response, Problem> {
        let url = format!("{}{}", self.base(cell)?, f.path_and_query);
        let mut headers = reqwest::header::HeaderMap::new();
        for (k, v) in &f.headers {
            if !hop_by_hop(k) && k != "x-forwarded-for" {
                headers.append(k.clone(), v.clone());
            }
        }
        let mut xff = crate::edge::forwarded_for_lines(&f.headers);
        xff.push(f.peer.ip().to_string());
        if let Ok(v) = xff.join(", ").parse() {
            headers.insert("x-forwarded-for", v);
        }
        let client = if f.stream { &self.streams } else { &self.http };
        let sent = client.request(f.method.clone(), url).headers(headers).body(f.body.clone()).send();
        // An order stream's client has no bound on the whole answer: its head has this one.
        let sent = match tokio::time::timeout(self.timeout, sent).await {
            Ok(sent) => sent.map_err(|e| e.to_string()),
            Err(_) => Err(format!("no answer within {} ms", self.timeout.as_millis())),
        };
        sent.map_err(|e| {
            tracing::warn!(cell, error = %e, "cell unreachable");
            metrics::counter!("boxoffice_router_upstream_errors_total", "cell" => cell.to_owned())
                .increment(1);
            let mut p = Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "cell_unavailable",
                "Purchase cell unavailable",
                "the event's purchase cell did not answer; retry with the same Idempotency-Key",
            );
            p.retry_after = Some(1);
            p
        })
    }

    async fn forward(&self, cell: &str, f: &Forward) -> Result<Response, Problem> {
        relay(self.send(cell, f).await?, None).await
    }

    /// A stream's places in the router's bounds ([`StreamBounds`]), or 429 `too_many_streams`.
    fn admit_stream(&self, peer: SocketAddr, headers: &HeaderMap) -> Result<StreamPlaces, Problem> {
        let key = self
            .streams_per_ip
            .client_key(Some(peer.ip()), headers)
            .unwrap_or_else(|| crate::edge::bucket_key(peer.ip()));
        let ip = match self.streams_per_ip.max() {
            0 => None,
            max => Some(self.streams_per_ip.enter(key).ok_or_else(|| {
                metrics::counter!("boxoffice_router_streams_refused_total", "scope" => "ip").increment(1);
                Problem::too_many_streams("ip", max)
            })?),
        };
        let process = self.stream_slots.clone().try_acquire_owned().map_err(|_| {
            metrics::counter!("boxoffice_router_streams_refused_total", "scope" => "process").increment(1);
            Problem::too_many_streams("process", self.stream_max)
        })?;
        Ok(StreamPlaces { _process: process, _ip: ip })
    }

    /// Asks every cell at once; the first success names the id's cell (the pair is then
    /// cached). A cell that refuses (429, 503) may not own the id, so its answer is relayed
    /// only when no cell answers with a success; a 404 only when every cell said so.
    async fn find(&self, id: Uuid, f: &Forward) -> Result<Found, Problem> {
        let mut asks: futures::stream::FuturesUnordered<_> =
            self.cells.keys().map(|cell| async move { (cell.clone(), self.send(cell, f).await) }).collect();
        let mut not_found = None;
        let mut refused = None;
        let mut failed = None;
        while let Some((cell, answer)) = futures::StreamExt::next(&mut asks).await {
            match answer {
                Ok(r) if r.status().is_success() => {
                    self.located.insert(id, cell.clone()).await;
                    return Ok(Found::Owner(cell, r));
                }
                Ok(r) if r.status() == StatusCode::NOT_FOUND => not_found = Some(r),
                Ok(r) => refused = refused.or(Some(r)),
                Err(p) => failed = Some(p),
            }
        }
        match (refused, failed, not_found) {
            (Some(r), _, _) => Ok(Found::Answer(r)),
            // A cell that did not answer may be the one: not a 404.
            (None, Some(p), _) => Err(p),
            (None, None, Some(r)) => Ok(Found::Answer(r)),
            (None, None, None) => Err(Problem::not_found("route")),
        }
    }
}

/// The cell's answer, for the client: read whole first, or, for an event stream
/// (`text/event-stream`) admitted with `places`, passed on chunk by chunk until the cell ends
/// it, it stays silent for the stream's idle bound, or the client leaves (the cell's
/// connection is then closed too); the places are freed then.
async fn relay(r: reqwest::Response, places: Option<StreamPlaces>) -> Result<Response, Problem> {
    let status = r.status();
    let mut headers = HeaderMap::new();
    for (k, v) in r.headers() {
        if !hop_by_hop(k) {
            headers.append(k.clone(), v.clone());
        }
    }
    let streamed = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if let (true, Some(places)) = (streamed, places) {
        let chunks = futures::stream::unfold(Some((r, places)), |state| async move {
            let (mut r, places) = state?;
            match r.chunk().await {
                Ok(Some(chunk)) => Some((Ok(chunk), Some((r, places)))),
                Ok(None) => None,
                // Passed on as a broken body (the client's connection is cut), then the end.
                Err(e) => Some((Err(e), None)),
            }
        });
        let mut resp = Response::new(Body::from_stream(chunks));
        *resp.status_mut() = status;
        *resp.headers_mut() = headers;
        return Ok(resp);
    }
    let body = r.bytes().await.map_err(|_| {
        let mut p = Problem::new(
            StatusCode::BAD_GATEWAY,
            "cell_answer_incomplete",
            "Incomplete answer",
            "the purchase cell's answer broke off; retry with the same Idempotency-Key",
        );
        p.retry_after = Some(1);
        p
    })?;
    let mut resp = Response::new(Body::from(body));
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    Ok(resp)
}
