//! The waiting room's HTTP face (design §3): join, poll, leave (the rate buckets in front of
//! these routes are [`crate::limits`]'s). Buyers join an event's queue, poll their ticket (each poll is the
//! heartbeat that keeps the position), and receive an admission token once the release step
//! has let them in. The token is minted on the poll (Ed25519; its `jti` is the ticket, its
//! `exp` the end of the admission slot) and is the same on every poll of one slot.
//!
//! These routes have their own share of the process's request slots
//! (`AppState::settings.queue_max_concurrent`, 503 `overloaded` beyond it), so a crowd
//! waiting on a slow Redis never takes the slots of holds and webhooks. While their 503s
//! (any: shed, Redis or the ledger unavailable) keep coming, their `Retry-After` is widened
//! up to a sixth of `abandon_after_ms` ([`crate::edge::RefusalBackoff`]), so a refused crowd
//! spreads out instead of coming back every few seconds.
//!
//! Redis is a shield, not a ledger: when it is unreachable these routes answer 503 with
//! `Retry-After` and nothing about seats changes; the hold endpoint keeps serving buyers who
//! already hold a valid token. Handlers never log tokens.

use crate::auth::{IdPath, User};
use crate::problem::Problem;
use crate::state::{AppState, EventInfo};
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use boxoffice_admission::AdmissionClaims;
use boxoffice_domain::{EventId, UserId};
use boxoffice_waitroom::{TicketState, WaitroomError};
use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

/// A queue ticket as the client sees it (join and poll answers).
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct QueueView {
    /// The ticket: poll `GET /queue/{ticket}` with it.
    pub ticket: Uuid,
    /// The event.
    pub event_id: Uuid,
    /// `pre_queue` (joined before the onsale opened; shuffled in at the opening), `queued`
    /// or `admitted`.
    #[schema(example = "queued")]
    pub state: String,
    /// 1-based position while `queued`.
    pub position: Option<u64>,
    /// Estimated wait while `queued`, seconds: position ÷ the rate the release controller
    /// admits this event at now (the rate it recorded with its last release, valid for
    /// three of its ticks and at least 10 s; at least 0.01/s), or ÷ its ceiling
    /// `release_max_per_s` when no live rate is known (then a lower bound).
    pub estimated_wait_s: Option<u64>,
    /// When the onsale opens, while `pre_queue`.
    pub opens_at: Option<DateTime<Utc>>,
    /// Poll again after this long, ms: the configured interval near the head of the queue,
    /// longer further back (a quarter of the estimated wait, or of the time left before the
    /// opening while `pre_queue`; at most a third of the time after which an unpolled
    /// position lapses).
    pub poll_after_ms: u64,
    /// Once `admitted`: the admission token for `X-Admission-Token` (not consumed by use).
    pub admission_token: Option<String>,
    /// Once `admitted`: end of the admission slot (the token's `exp`).
    pub admission_expires_at: Option<DateTime<Utc>>,
    /// Once `admitted`: the purchase cell serving the event.
    pub purchase_cell: Option<String>,
}

struct View {
    ticket: Uuid,
    event: Uuid,
    state: TicketState,
    position: Option<u64>,
    opens_at: Option<DateTime<Utc>>,
    slot_ends_at: Option<DateTime<Utc>>,
    release_per_s: Option<f64>,
    /// The event's directory epoch here, read when the ticket is admitted (the token's).
    directory_epoch: Option<i64>,
}

/// The lowest release rate a wait is estimated with, positions per second: below it (a
/// controller at its floor, or stopped) the estimate is capped rather than infinite.
const MIN_ESTIMATE_RATE: f64 = 0.01;

fn render(st: &AppState, user: UserId, v: View) -> QueueView {
    let rate = match v.release_per_s {
        // The controller's word, however low: a floor keeps the estimate finite.
        Some(live) => live.max(MIN_ESTIMATE_RATE),
        None => st.settings.release_per_s,
    };
    let estimated_wait_s = match v.position {
        Some(p) if rate > 0.0 => Some((p as f64 / rate).ceil() as u64),
        _ => None,
    };
    // Before the opening nobody has a position; the wait is the time to the opening.
    let opening_in_s = v.opens_at.map(|at| (at - chrono::Utc::now()).num_seconds().max(0) as u64);
    let advice_wait_s = estimated_wait_s.or(opening_in_s);
    let token = match (v.state, v.slot_ends_at, v.directory_epoch) {
        (TicketState::Admitted, Some(end), Some(directory_epoch)) => {
            let exp = end.timestamp(); // whole seconds, rounded down: never past the slot
            let claims = AdmissionClaims {
                jti: v.ticket,
                sub: user.0,
                event_id: v.event,
                purchase_cell: st.admission.cell().to_owned(),
                directory_epoch,
                iat: exp - st.settings.admission_ttl_s,
                exp,
            };
            Some((st.admission.sign(&claims), DateTime::from_timestamp(exp, 0)))
        }
        _ => None,
    };
    let poll_after_ms =
        poll_after_ms(st.settings.poll_interval_ms, st.waitroom.config().abandon_after_ms, advice_wait_s);
    let admitted = token.is_some();
    let (admission_token, admission_expires_at) = match token {
        Some((t, at)) => (Some(t), at),
        None => (None, None),
    };
    QueueView {
        ticket: v.ticket,
        event_id: v.event,
        state: v.state.as_str().to_owned(),
        position: v.position,
        estimated_wait_s,
        opens_at: v.opens_at,
        poll_after_ms,
        admission_token,
        admission_expires_at,
        purchase_cell: admitted.then(|| st.admission.cell().to_owned()),
    }
}

/// How long a client should wait before its next poll, ms: the configured interval near the
/// head of the queue, and a quarter of the estimated wait further back (a buyer 10 minutes out
/// gains nothing from polling every 2 s, and the crowd's polls are most of the waiting room's
/// load), never more than a third of `abandon_after_ms`, so a client that follows the advice
/// keeps its position even if one poll is lost.
fn poll_after_ms(interval_ms: u64, abandon_after_ms: u64, estimated_wait_s: Option<u64>) -> u64 {
    let ceiling = (abandon_after_ms / 3).max(interval_ms);
    match estimated_wait_s {
        Some(w) => (w.saturating_mul(1_000) / 4).clamp(interval_ms, ceiling),
        None => interval_ms,
    }
}

fn no_store(mut resp: Response) -> Response {
    // Carries the admission token once admitted: never cache.
    resp.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// `POST /events/{event_id}/queue` → 201 + `Location: /queue/{ticket}` for a new position,
/// 200 with the same ticket when the user already queues for this event.
#[utoipa::path(post, path = "/events/{event_id}/queue", tag = "waiting room",
    params(("event_id" = Uuid, Path, description = "Event id")),
    security(("bearer" = [])),
    responses(
        (status = 201, description = "Queued (or pre-queued before the onsale opens); `Location: /queue/{ticket}`", body = QueueView),
        (status = 200, description = "The user already queues for this event: the same ticket", body = QueueView),
        (status = 400, description = "`invalid_path`: the event id is not a UUID", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 401, description = "`unauthenticated`: no or invalid bearer token", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 403, description = "`sales_not_open`: the event was never scheduled; `sales_closed`: its sales window has closed", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 404, description = "`not_found`: no such event", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 409, description = "`queue_position_limit`: the user holds too many positions across events; `event_in_another_cell`: another purchase cell sells the event (`purchase_cell`), join there", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 429, description = "`rate_limited` (per IP or per user, named in `scope`), or `too_many_in_flight` (this client address has `max_in_flight` requests in progress); `Retry-After` in seconds", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 503, description = "`waitroom_unavailable`: Redis is unreachable; `unavailable`: the database is; `overloaded`: this process has `waitroom_max_concurrent_requests` queue requests in progress; `event_moving`: the event is moving to another purchase cell; `Retry-After`", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
    ))]
pub(crate) async fn join(
    State(st): State<AppState>,
    user: User,
    IdPath(event): IdPath<Uuid>,
) -> Result<Response, Problem> {
    ensure_on_sale(&st, event).await?;
    let t = st.waitroom.join(EventId(event), user.0).await?;
    let directory_epoch = match t.state {
        TicketState::Admitted => Some(minting_epoch(&st, event).await?),
        _ => None,
    };
    let view = View {
        directory_epoch,
        ticket: t.ticket,
        event,
        state: t.state,
        position: t.position,
        opens_at: t.opens_at,
        slot_ends_at: t.slot_ends_at,
        release_per_s: t.release_per_s,
    };
    let status = if t.created { StatusCode::CREATED } else { StatusCode::OK };
    let mut resp = (status, Json(render(&st, user.0, view))).into_response();
    let location = format!("/queue/{}", t.ticket);
    resp.headers_mut().insert(header::LOCATION, HeaderValue::from_str(&location).expect("uuid path"));
    Ok(no_store(resp))
}

/// `GET /queue/{ticket}` → where the ticket stands; the admission token once released.
#[utoipa::path(get, path = "/queue/{ticket}", tag = "waiting room",
    params(("ticket" = Uuid, Path, description = "Queue ticket")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Position and estimated wait, or the admission token once admitted. Polling keeps the position.", body = QueueView),
        (status = 400, description = "`invalid_path`: the ticket is not a UUID", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 401, description = "`unauthenticated`: no or invalid bearer token", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 404, description = "`queue_ticket_not_found`: unknown, not the caller's, left, lapsed, or the slot ended", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 409, description = "`event_in_another_cell`: admitted, but the event has moved to another purchase cell (`purchase_cell`): join there", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 429, description = "`rate_limited` (per IP or per user, named in `scope`), or `too_many_in_flight` (this client address has `max_in_flight` requests in progress); `Retry-After` in seconds", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 503, description = "`waitroom_unavailable`: Redis is unreachable; `overloaded`: this process has `waitroom_max_concurrent_requests` queue requests in progress; `Retry-After`", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
    ))]
pub(crate) async fn status(
    State(st): State<AppState>,
    user: User,
    IdPath(ticket): IdPath<Uuid>,
) -> Result<Response, Problem> {
    let s = st.waitroom.status(ticket, user.0).await?;
    let directory_epoch = match s.state {
        TicketState::Admitted => Some(minting_epoch(&st, s.event.0).await?),
        _ => None,
    };
    let view = View {
        directory_epoch,
        ticket,
        event: s.event.0,
        state: s.state,
        position: s.position,
        opens_at: s.opens_at,
        slot_ends_at: s.slot_ends_at,
        release_per_s: s.release_per_s,
    };
    Ok(no_store(Json(render(&st, user.0, view)).into_response()))
}

/// `DELETE /queue/{ticket}` → 204. Leaving during an admission slot revokes its token: in
/// the ledger first (so a Redis restart cannot bring it back), then in Redis with the leave
/// itself. A ledger failure is a 503 with nothing changed.
#[utoipa::path(delete, path = "/queue/{ticket}", tag = "waiting room",
    params(("ticket" = Uuid, Path, description = "Queue ticket")),
    security(("bearer" = [])),
    responses(
        (status = 204, description = "Left the queue (a running admission slot's token is revoked)"),
        (status = 400, description = "`invalid_path`: the ticket is not a UUID", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 401, description = "`unauthenticated`: no or invalid bearer token", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 404, description = "`queue_ticket_not_found`", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 429, description = "`rate_limited` (per IP or per user, named in `scope`), or `too_many_in_flight` (this client address has `max_in_flight` requests in progress); `Retry-After` in seconds", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
        (status = 503, description = "`waitroom_unavailable`: Redis is unreachable; `unavailable`: the revocation could not be recorded in the database (nothing changed); `overloaded`: this process has `waitroom_max_concurrent_requests` queue requests in progress; `Retry-After`", body = crate::openapi::ProblemDocument, content_type = "application/problem+json"),
    ))]
pub(crate) async fn leave(
    State(st): State<AppState>,
    user: User,
    IdPath(ticket): IdPath<Uuid>,
) -> Result<Response, Problem> {
    let slot = st.waitroom.admission_slot(ticket, user.0).await?;
    if let Some(until) = slot {
        boxoffice_store::revocations::record(&st.pool, ticket, until).await?;
    }
    if let Some(until) = st.waitroom.leave(ticket, user.0).await? {
        if slot.is_none() {
            // Released between the two calls: record it now (Redis already has it).
            boxoffice_store::revocations::record(&st.pool, ticket, until).await?;
        }
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// The event's sales window and placement from the ledger (through
/// [`crate::state::EVENT_CACHE_TTL`]'s cache, absences included, so a stampede of joins or
/// holds costs the ledger one query per event and TTL); 404 when the event does not exist.
pub(crate) async fn event_info(st: &AppState, event: Uuid) -> Result<EventInfo, Problem> {
    let cached = st.event_windows.lock().expect("event cache poisoned").get(&event).cloned();
    let window = match cached {
        Some((at, w)) if at.elapsed() < crate::state::EVENT_CACHE_TTL => w,
        _ => {
            let w = boxoffice_store::cells::event_info(&st.pool, EventId(event))
                .await?
                .map(|(window, placement)| EventInfo { window, placement });
            let mut cache = st.event_windows.lock().expect("event cache poisoned");
            if cache.len() > 100_000 {
                cache.clear(); // junk ids must not grow it without bound
            }
            cache.insert(event, (std::time::Instant::now(), w.clone()));
            w
        }
    };
    window.ok_or_else(|| Problem::not_found("event"))
}

/// The directory epoch this cell mints admission tokens for `event` at: the ledger's, while
/// this cell sells the event (else the refusal: moved away, or moving).
pub(crate) async fn minting_epoch(st: &AppState, event: Uuid) -> Result<i64, Problem> {
    let p = event_info(st, event).await?.placement;
    p.admits(st.admission.cell(), p.directory_epoch).map_err(Problem::placement)?;
    Ok(p.directory_epoch)
}

/// Case C18: the opening is the ledger's. Joins for an event another cell sells are refused
/// (409 `event_in_another_cell`, 503 `event_moving`); joins after closing, or for an event never
/// scheduled, are refused (403); before the opening the waiting room's cached schedule is
/// (re)written from the ledger first — a Redis that restarted and forgot it would otherwise
/// queue first come, first served and open at once.
async fn ensure_on_sale(st: &AppState, event: Uuid) -> Result<(), Problem> {
    let info = event_info(st, event).await?;
    let p = &info.placement;
    p.admits(st.admission.cell(), p.directory_epoch).map_err(Problem::placement)?;
    let window = info.window;
    let now = chrono::Utc::now();
    let Some(opens_at) = window.opens_at else {
        return Err(Problem::sales_not_open(None));
    };
    if window.closes_at.is_some_and(|c| c <= now) {
        return Err(Problem::sales_closed());
    }
    if opens_at > now {
        match st.waitroom.schedule(EventId(event), opens_at, None).await {
            Ok(()) | Err(WaitroomError::AlreadyOpen) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::poll_after_ms;

    #[test]
    fn poll_interval_grows_with_the_wait_but_never_risks_the_position() {
        // Near the head, or no estimate: the configured interval.
        assert_eq!(poll_after_ms(2_000, 30_000, None), 2_000);
        assert_eq!(poll_after_ms(2_000, 30_000, Some(1)), 2_000);
        // 20 s out: a quarter of it.
        assert_eq!(poll_after_ms(2_000, 30_000, Some(20)), 5_000);
        // Far back: capped at a third of the lapse time.
        assert_eq!(poll_after_ms(2_000, 30_000, Some(3_600)), 10_000);
        // A configured interval above that cap is kept (config validation keeps it ≤ half).
        assert_eq!(poll_after_ms(12_000, 30_000, Some(3_600)), 12_000);
    }
}
