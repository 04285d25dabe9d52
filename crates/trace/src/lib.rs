//! The W3C trace context of one purchase (design §16): the one place that knows how a span's
//! context is written down and how a written-down context becomes a span's parent.
//!
//! A purchase crosses processes through the ledger and Kafka, never through a call, so its
//! trace travels as data: the span that commits an outbox row stores its `traceparent`
//! ([`current_traceparent`]) in the same INSERT; the relay sends the stored value as the
//! message's [`TRACEPARENT`] header (and in the envelope, so retry copies and replayed dead
//! letters keep it); a consumer's span takes it as parent ([`set_parent`]), and the facts its
//! handler writes store the consumer span's context in turn. The payment worker also copies the
//! stored value of the fact that asked for a PaymentIntent into the intent's metadata, which is
//! how Stripe's webhooks find their way back into the trace (see `boxoffice_api::webhooks`).
//!
//! Off unless the process installed an OpenTelemetry layer and called [`enable`]: then
//! [`current_traceparent`] is `None` after one relaxed atomic load and [`set_parent`] does
//! nothing, so a deployment without a collector pays nothing else. The format is W3C Trace
//! Context level 1 (`00-{trace-id}-{parent-id}-{flags}`); a value that does not parse, or names
//! the all-zero trace or span, is ignored (the span starts a trace of its own), never an error.

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TraceContextExt;
use std::sync::atomic::{AtomicBool, Ordering};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The W3C header (Kafka header, HTTP header, outbox column and PaymentIntent metadata key).
pub const TRACEPARENT: &str = "traceparent";

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Marks tracing on for this process: called once the OpenTelemetry layer and the W3C
/// propagator are installed.
pub fn enable() {
    ENABLED.store(true, Ordering::Release);
}

/// Whether this process exports spans (one relaxed load: the check every caller makes first).
#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The `traceparent` of the current span; `None` when tracing is off or the current span has
/// no valid context (no span, or one the OpenTelemetry layer does not see).
pub fn current_traceparent() -> Option<String> {
    if !enabled() {
        return None;
    }
    traceparent_of(&tracing::Span::current())
}

/// The `traceparent` of `span` (see [`current_traceparent`]).
pub fn traceparent_of(span: &tracing::Span) -> Option<String> {
    if !enabled() || span.is_disabled() {
        return None;
    }
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = One(None);
    opentelemetry::global::get_text_map_propagator(|p| p.inject_context(&cx, &mut carrier));
    carrier.0
}

/// Makes the context `traceparent` names the parent of `span`, which must not have been
/// entered yet. Nothing happens when tracing is off, `traceparent` is `None` or does not
/// parse: `span` then keeps the parent it has (or starts a trace).
pub fn set_parent(span: &tracing::Span, traceparent: Option<&str>) {
    let Some(cx) = traceparent.filter(|_| enabled()).and_then(context_of) else { return };
    // Fails only when the span was already started or is filtered out: it keeps its parent.
    let _ = span.set_parent(cx);
}

/// Adds a link from `span` to the context `traceparent` names (e.g. the webhook's span in the
/// order's trace to the HTTP request that carried it). Ignored like [`set_parent`].
pub fn add_link(span: &tracing::Span, traceparent: Option<&str>) {
    let Some(cx) = traceparent.filter(|_| enabled()).and_then(context_of) else { return };
    span.add_link(cx.span().span_context().clone());
}

/// The remote context `traceparent` names, when it parses and is valid.
pub fn context_of(traceparent: &str) -> Option<opentelemetry::Context> {
    let carrier = One(Some(traceparent.to_owned()));
    let cx = opentelemetry::global::get_text_map_propagator(|p| p.extract(&carrier));
    cx.span().span_context().is_valid().then_some(cx)
}

/// The `traceparent` among `headers` (HTTP, case-insensitive), for [`set_parent`].
pub fn from_headers<'a, I>(headers: I) -> Option<&'a str>
where
    I: IntoIterator<Item = (&'a str, &'a [u8])>,
{
    headers
        .into_iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(TRACEPARENT))
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
}

/// A carrier of the one header this crate reads and writes (`tracestate` is not kept).
struct One(Option<String>);

impl Injector for One {
    fn set(&mut self, key: &str, value: String) {
        if key == TRACEPARENT {
            self.0 = Some(value);
        }
    }
}

impl Extractor for One {
    fn get(&self, key: &str) -> Option<&str> {
        (key == TRACEPARENT).then_some(self.0.as_deref()).flatten()
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT]
    }
}

/// Labels every span and log line of a process's roles carries beside its own ids: the
/// deployment's region and purchase cell (design §16).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Labels {
    /// The region (`Config::region`).
    pub region: String,
    /// The purchase cell (`Config::purchase_cell`).
    pub purchase_cell: String,
}

impl Default for Labels {
    fn default() -> Self {
        Self { region: "primary".into(), purchase_cell: "cell-1".into() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    fn with_tracing(f: impl FnOnce()) {
        use opentelemetry::trace::TracerProvider as _;
        opentelemetry::global::set_text_map_propagator(
            opentelemetry_sdk::propagation::TraceContextPropagator::new(),
        );
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        enable();
        tracing::subscriber::with_default(subscriber, f);
    }

    const STORED: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_span_joined_to_a_stored_context_continues_its_trace() {
        with_tracing(|| {
            let span = tracing::info_span!("consume");
            set_parent(&span, Some(STORED));
            let _g = span.enter();
            let child = current_traceparent().expect("a valid context");
            assert!(child.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"), "{child}");
            assert!(!child.contains("00f067aa0ba902b7"), "the child's own span id: {child}");
            assert!(child.ends_with("-01"));
        });
    }

    #[test]
    fn junk_and_all_zero_contexts_are_ignored() {
        with_tracing(|| {
            for bad in [
                "",
                "junk",
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            ] {
                assert!(context_of(bad).is_none(), "{bad:?}");
                let span = tracing::info_span!("consume");
                set_parent(&span, Some(bad));
                let _g = span.enter();
                let own = current_traceparent().expect("a trace of its own");
                assert!(!own.contains("4bf92f3577b34da6a3ce929d0e0e4736"), "{own}");
            }
        });
    }

    #[test]
    fn without_a_span_there_is_no_traceparent() {
        with_tracing(|| assert_eq!(current_traceparent(), None));
    }
}
