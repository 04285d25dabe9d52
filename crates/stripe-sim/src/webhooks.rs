//! Asynchronous, concurrent, at-least-once webhook delivery, as Stripe does it
//! (<https://docs.stripe.com/webhooks#retries>): each event is POSTed as JSON to the endpoint
//! with a `Stripe-Signature` header, and retried with exponential backoff (initial backoff
//! doubling, capped at 5 s) until a 2xx or the attempt limit.
//!
//! Owns the event queue, the delivery task and its counters. Faults shape delivery:
//! `webhook_delay_ms` holds each batch back, `webhook_duplicates` sends extra copies with the
//! same `evt_` id, `webhook_reorder` shuffles a batch. Each attempt is signed afresh with the
//! *wall-clock* time (not the test clock), so receivers can verify with their own clock.
//!
//! Invariant: `outstanding` counts every event copy that is queued or still being attempted;
//! it reaches zero only when all were delivered, abandoned, or dropped because no endpoint is
//! configured. Events emitted while no endpoint is set are dropped, as Stripe only sends
//! events created after an endpoint exists. Bodies are never logged, only event id and type.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::StripeSim;

const MAX_BACKOFF: Duration = Duration::from_secs(5);
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(10);
/// Delivery attempts in flight at once, first attempts and retries together (a retry waits
/// out its backoff without a slot). All come from one address, where Stripe's come from
/// several: a receiver limiting webhooks per address must allow this many to take them all.
pub const MAX_CONCURRENT_DELIVERIES: usize = 32;

/// The queue between the API handlers and the delivery task.
pub(crate) struct WebhookQueue {
    tx: mpsc::UnboundedSender<Value>,
    rx: Mutex<Option<mpsc::UnboundedReceiver<Value>>>,
    outstanding: watch::Sender<usize>,
    pub attempted: AtomicU64,
    pub succeeded: AtomicU64,
    pub abandoned: AtomicU64,
}

impl WebhookQueue {
    pub fn new() -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Self {
            tx,
            rx: Mutex::new(Some(rx)),
            outstanding: watch::Sender::new(0),
            attempted: AtomicU64::new(0),
            succeeded: AtomicU64::new(0),
            abandoned: AtomicU64::new(0),
        }
    }

    pub fn enqueue(&self, events: Vec<Value>) {
        for event in events {
            self.outstanding.send_modify(|n| *n += 1);
            if self.tx.send(event).is_err() {
                self.finish_one();
            }
        }
    }

    fn finish_one(&self) {
        self.outstanding.send_modify(|n| *n = n.saturating_sub(1));
    }

    /// True once nothing is queued or in flight, false if `timeout` passes first.
    pub async fn wait_idle(&self, timeout: Duration) -> bool {
        let mut rx = self.outstanding.subscribe();
        let idle = tokio::time::timeout(timeout, rx.wait_for(|n| *n == 0)).await;
        matches!(idle, Ok(Ok(_)))
    }
}

/// Delivers queued events until `shutdown`. Only one delivery task runs per simulator; a
/// second call returns at once.
pub(crate) async fn run(sim: StripeSim, shutdown: CancellationToken) {
    let queue = &sim.shared.webhooks;
    let Some(mut rx) = queue.rx.lock().unwrap_or_else(|e| e.into_inner()).take() else {
        tracing::warn!("webhook delivery task already running");
        return;
    };
    let http =
        reqwest::Client::builder().timeout(DELIVERY_TIMEOUT).build().expect("default reqwest client builds");
    let retries = TaskTracker::new();
    let in_flight = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_DELIVERIES));
    loop {
        let first = tokio::select! {
            _ = shutdown.cancelled() => break,
            ev = rx.recv() => match ev { Some(ev) => ev, None => break },
        };
        let faults = sim.faults();
        if faults.webhook_delay_ms > 0 {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(Duration::from_millis(faults.webhook_delay_ms)) => {}
            }
        }
        let mut batch = vec![first];
        while let Ok(ev) = rx.try_recv() {
            batch.push(ev);
        }
        if faults.webhook_duplicates > 0 {
            let copies = faults.webhook_duplicates as usize;
            queue.outstanding.send_modify(|n| *n += batch.len() * copies);
            batch = batch.into_iter().flat_map(|ev| std::iter::repeat_n(ev, copies + 1)).collect();
        }
        if faults.webhook_reorder {
            sim.with_fault_state(|f| f.shuffle(&mut batch));
        }
        for event in batch {
            // Like Stripe, deliveries run concurrently (bounded), so order is not guaranteed.
            let permit = tokio::select! {
                _ = shutdown.cancelled() => break,
                p = in_flight.clone().acquire_owned() => p.expect("never closed"),
            };
            let (sim, http, shutdown, slots) =
                (sim.clone(), http.clone(), shutdown.clone(), in_flight.clone());
            retries.spawn(async move {
                let body = serde_json::to_vec_pretty(&event).expect("JSON values serialize");
                let delivered = attempt(&sim, &http, &event, &body, 1).await;
                drop(permit);
                if delivered {
                    sim.shared.webhooks.finish_one();
                } else {
                    retry(sim, http, event, body, slots, shutdown).await;
                }
            });
        }
    }
    // Hand the receiver back so a later `serve` can resume delivery of what is still queued.
    *queue.rx.lock().unwrap_or_else(|e| e.into_inner()) = Some(rx);
    retries.close();
    retries.wait().await;
}

/// Attempts 2..=max with doubling backoff, each in one of `slots`; gives up quietly on
/// shutdown.
async fn retry(
    sim: StripeSim,
    http: reqwest::Client,
    event: Value,
    body: Vec<u8>,
    slots: std::sync::Arc<tokio::sync::Semaphore>,
    shutdown: CancellationToken,
) {
    let mut backoff = Duration::from_millis(sim.shared.webhook_initial_backoff_ms);
    for n in 2..=sim.shared.webhook_max_attempts {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        let _slot = tokio::select! {
            _ = shutdown.cancelled() => return,
            p = slots.acquire() => p.expect("never closed"),
        };
        if attempt(&sim, &http, &event, &body, n).await {
            sim.shared.webhooks.finish_one();
            return;
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
    tracing::warn!(event.id = %event["id"], event.type = %event["type"], "webhook delivery abandoned");
    sim.shared.webhooks.abandoned.fetch_add(1, Ordering::Relaxed);
    sim.shared.webhooks.finish_one();
}

/// One signed POST. True when done: delivered (2xx), or no endpoint configured.
async fn attempt(sim: &StripeSim, http: &reqwest::Client, event: &Value, body: &[u8], n: u32) -> bool {
    let Some(url) = sim.webhook_url() else {
        return true;
    };
    let queue = &sim.shared.webhooks;
    queue.attempted.fetch_add(1, Ordering::Relaxed);
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    let signature = boxoffice_payments::webhook::sign(body, &sim.shared.webhook_secret, now);
    let result = http
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json; charset=utf-8")
        .header(boxoffice_payments::webhook::SIGNATURE_HEADER, signature)
        .header(reqwest::header::USER_AGENT, "Stripe/1.0 (+https://stripe.com/docs/webhooks)")
        .body(body.to_vec())
        .send()
        .await;
    match result {
        Ok(resp) if resp.status().is_success() => {
            queue.succeeded.fetch_add(1, Ordering::Relaxed);
            true
        }
        Ok(resp) => {
            tracing::debug!(event.id = %event["id"], attempt = n, http.status = resp.status().as_u16(), "webhook rejected");
            false
        }
        Err(e) => {
            tracing::debug!(event.id = %event["id"], attempt = n, error = %e, "webhook delivery failed");
            false
        }
    }
}
