//! Fault points (design §17): named places at every boundary of the purchase path where a
//! test or the chaos run can make the process fail — before a remote call, after remote
//! success, before the local commit, after the local commit and before the acknowledgement
//! (offset commit or HTTP response). They exist to prove invariants 4–6 under crashes: every
//! boundary must be safe to die at, because the step before it is replayed with the same
//! idempotency key or deduplicated by the inbox.
//!
//! The mechanism is the `fail` crate (TiKV's fail points), compiled in but **inert unless
//! configured**: an unconfigured point costs one read-locked map lookup. Configuration comes
//! from `BOXOFFICE_FAULTS` (the `faults` setting) at start-up, or from [`set`] in tests, in
//! `fail`'s action syntax: `point=[p%][n*]return(mode)`, `;`-separated. Modes:
//!
//! - `return` or `return(error)`: the step fails with [`Injected`], which callers treat as a
//!   transient error (the consumer retries, the relay retries, webhook ingress answers 500);
//! - `return(abort)`: the process aborts on the spot, as if killed (no destructors, no
//!   flush, no offset commit);
//! - `sleep(ms)`: the step stalls for `ms` milliseconds (blocking the thread).
//!
//! Example: `BOXOFFICE_FAULTS='payments.after_remote=5%return(abort);relay.after_publish=1*return'`.
//! [`POINTS`] lists every point of the purchase path, [`OBSERVER_POINTS`] the others.

/// Boundaries of every consumer; the point name is `{consumer}.{boundary}`, e.g.
/// `payments.after_remote`.
pub const CONSUMER_BOUNDARIES: [&str; 5] =
    ["before_remote", "after_remote", "before_commit", "after_commit", "before_ack"];

/// Every fault point of the purchase path (a purchase passes each of them), for documentation
/// and for rejecting misspelt configuration; [`OBSERVER_POINTS`] lists the others.
pub const POINTS: &[&str] = &[
    // The outbox relay: publish, then mark published.
    "relay.before_publish",
    "relay.after_publish",
    "relay.after_commit",
    // Consumers (saga, payments, tickets) on the main and retry topics.
    "saga.before_remote",
    "saga.after_remote",
    "saga.before_commit",
    "saga.after_commit",
    "saga.before_ack",
    "payments.before_remote",
    "payments.after_remote",
    "payments.before_commit",
    "payments.after_commit",
    "payments.before_ack",
    "tickets.before_remote",
    "tickets.after_remote",
    "tickets.before_commit",
    "tickets.after_commit",
    "tickets.before_ack",
    // Stripe webhook ingress: before the stripe_events + outbox commit, and after it but
    // before the HTTP response.
    "webhook.before_commit",
    "webhook.after_commit",
    // The hold transaction of the API.
    "hold.before_commit",
    "hold.after_commit",
];

/// Fault points outside the purchase path, which no purchase passes through: the view reader
/// of the buyers' order streams (`order_stream.read`: one read of the marked orders fails as
/// a whole, as a failed statement would).
pub const OBSERVER_POINTS: &[&str] = &["order_stream.read"];

/// Whether `point` is a fault point ([`POINTS`] or [`OBSERVER_POINTS`]).
pub fn is_point(point: &str) -> bool {
    POINTS.contains(&point) || OBSERVER_POINTS.contains(&point)
}

/// A fault injected at `point` (mode `error`).
#[derive(Debug, Clone, thiserror::Error)]
#[error("fault injected at {point}")]
pub struct Injected {
    /// The fault point that fired.
    pub point: String,
}

/// Evaluates fault point `point`: `Ok(())` unless it is configured and fires. With mode
/// `abort` it does not return.
pub fn check(point: &str) -> Result<(), Injected> {
    if !ARMED.load(std::sync::atomic::Ordering::Relaxed) {
        return Ok(());
    }
    match fail::eval(point, |arg| arg) {
        None => Ok(()),
        Some(arg) => {
            record_firing(point);
            fire(point, arg)
        }
    }
}

/// Evaluates consumer fault point `{consumer}.{boundary}` (see [`CONSUMER_BOUNDARIES`]);
/// the name is only built when some point is armed, so the per-message cost of an inert
/// mechanism is one atomic load.
pub fn check_consumer(consumer: &str, boundary: &str) -> Result<(), Injected> {
    if !ARMED.load(std::sync::atomic::Ordering::Relaxed) {
        return Ok(());
    }
    check(&format!("{consumer}.{boundary}"))
}

/// Whether any point was ever armed in this process (set by [`set`] / [`configure`]).
static ARMED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

static FIRED: std::sync::Mutex<Vec<(String, u64)>> = std::sync::Mutex::new(Vec::new());

fn record_firing(point: &str) {
    let mut fired = FIRED.lock().unwrap_or_else(|e| e.into_inner());
    match fired.iter_mut().find(|(p, _)| p == point) {
        Some((_, n)) => *n += 1,
        None => fired.push((point.to_owned(), 1)),
    }
}

/// How many times `point` has fired in this process (any mode that returned).
pub fn fired(point: &str) -> u64 {
    FIRED.lock().unwrap_or_else(|e| e.into_inner()).iter().find(|(p, _)| p == point).map_or(0, |(_, n)| *n)
}

fn fire(point: &str, arg: Option<String>) -> Result<(), Injected> {
    match arg.as_deref() {
        Some("abort") => {
            // The log line is the only trace; the abort is meant to lose everything else.
            tracing::error!(fault.point = point, "fault injected: aborting the process");
            eprintln!("fault injected at {point}: aborting");
            std::process::abort();
        }
        None | Some("error") | Some("") => {
            tracing::warn!(fault.point = point, "fault injected: failing the step");
            Err(Injected { point: point.to_owned() })
        }
        Some(other) => {
            tracing::warn!(
                fault.point = point,
                mode = other,
                "fault injected (unknown mode treated as error)"
            );
            Err(Injected { point: point.to_owned() })
        }
    }
}

/// Arms `point` with `actions` (e.g. `1*return`, `10%return(abort)`). Unknown points are
/// rejected.
///
/// # Errors
/// The point is in neither [`POINTS`] nor [`OBSERVER_POINTS`], or the actions do not parse.
pub fn set(point: &str, actions: &str) -> Result<(), String> {
    if !is_point(point) {
        return Err(format!(
            "unknown fault point {point:?} (see boxoffice_faults::POINTS and OBSERVER_POINTS)"
        ));
    }
    fail::cfg(point, actions)?;
    ARMED.store(true, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// Disarms `point`.
pub fn clear(point: &str) {
    fail::remove(point);
}

/// Disarms every point.
pub fn clear_all() {
    for (name, _) in fail::list() {
        fail::remove(name);
    }
}

/// Checks a configuration string without arming anything: every entry is `point=actions`
/// with a known point.
///
/// # Errors
/// The first malformed entry or unknown point.
pub fn validate(spec: &str) -> Result<(), String> {
    parse(spec).map(|_| ())
}

fn parse(spec: &str) -> Result<Vec<(&str, &str)>, String> {
    let mut entries = Vec::new();
    for entry in spec.split(';').map(str::trim).filter(|e| !e.is_empty()) {
        let (point, actions) =
            entry.split_once('=').ok_or_else(|| format!("fault entry {entry:?} is not point=actions"))?;
        if !is_point(point.trim()) {
            return Err(format!("unknown fault point {:?}", point.trim()));
        }
        entries.push((point.trim(), actions.trim()));
    }
    Ok(entries)
}

/// Applies a configuration string `point=actions;point=actions` (the `faults` setting).
/// An empty string leaves every point inert.
///
/// # Errors
/// A malformed entry, an unknown point or unparsable actions; nothing is armed then.
pub fn configure(spec: &str) -> Result<(), String> {
    for (point, actions) in parse(spec)? {
        set(point, actions)?;
        tracing::warn!(fault.point = point, actions, "fault point armed");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_are_inert_until_armed_and_count_limits_apply() {
        assert!(check("relay.after_publish").is_ok());
        set("relay.after_publish", "2*return").unwrap();
        assert!(check("relay.after_publish").is_err());
        assert!(check("relay.after_publish").is_err());
        assert!(check("relay.after_publish").is_ok(), "fires at most twice");
        clear_all();
        assert!(check("relay.after_publish").is_ok());
    }

    #[test]
    fn configuration_rejects_unknown_points_and_malformed_entries() {
        assert!(configure("").is_ok());
        assert!(configure("relay.after_publsh=return").unwrap_err().contains("unknown"));
        assert!(configure("relay.after_publish").is_err());
        assert!(configure("relay.after_publish=bogus(").is_err());
        assert!(check("relay.after_publish").is_ok(), "nothing armed by a failed configure");
    }
}
