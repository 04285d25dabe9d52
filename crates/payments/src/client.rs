//! [`PaymentGateway`] and its Stripe implementation [`StripeClient`].
//!
//! Owns the wire format: `application/x-www-form-urlencoded` bodies with Stripe's bracket
//! syntax, `Authorization: Bearer`, `Idempotency-Key` on every mutating call, JSON responses,
//! and Stripe's error envelope (<https://docs.stripe.com/api>).
//!
//! Invariant: a mutating call is only ever sent with the caller's idempotency key, so a retry
//! after a timeout, a 409 or a 5xx replays Stripe's stored result instead of moving money
//! twice. Keys, client secrets and bodies are never logged; logs carry method, path (object
//! ids only), status, Stripe's `Request-Id` and duration.

use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::{Method, Url};
use secrecy::{ExposeSecret, SecretString};
use serde::de::DeserializeOwned;

use crate::types::{push_metadata, List};
use crate::{
    Charge, CreatePaymentIntent, CreatedWindow, Dispute, IntentWithCharge, PaymentIntent, Refund, StripeError,
};

/// Stripe caps idempotency keys at 255 characters.
const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;
/// Page size for auto-pagination (Stripe's maximum).
const LIST_PAGE_LIMIT: u32 = 100;

/// What the payment worker and saga may ask of a payment provider.
///
/// Every method maps to one Stripe request; none retries by itself. On error, consult
/// [`StripeError::is_retryable`] and retry with the *same* `idempotency_key` (design §10 uses
/// `authorize:{event_id}`, `capture:{order_id}`, `cancel:{payment_intent_id}`, `refund:{payment_intent_id}`).
/// Idempotency keys must be 1..=255 characters ([`StripeError::Config`] otherwise).
#[async_trait::async_trait]
pub trait PaymentGateway: Send + Sync + 'static {
    /// `POST /v1/payment_intents` with `amount`, `currency`, `capture_method=manual`,
    /// `automatic_payment_methods[enabled]=true` and `metadata[k]=v`
    /// (<https://docs.stripe.com/api/payment_intents/create>). The new intent is in
    /// `requires_payment_method`; its `client_secret` goes to the buyer's browser.
    async fn create_payment_intent(
        &self,
        req: &CreatePaymentIntent,
        idempotency_key: &str,
    ) -> Result<PaymentIntent, StripeError>;

    /// `GET /v1/payment_intents/{id}`. Unknown id: `Api { status: 404, code: "resource_missing" }`.
    async fn retrieve_payment_intent(&self, id: &str) -> Result<PaymentIntent, StripeError>;

    /// `GET /v1/charges/{id}` (<https://docs.stripe.com/api/charges/retrieve>): how much of a
    /// captured payment was refunded. Unknown id: `Api { status: 404, code: "resource_missing" }`.
    async fn retrieve_charge(&self, id: &str) -> Result<Charge, StripeError>;

    /// `GET /v1/disputes/{id}` (<https://docs.stripe.com/api/disputes/retrieve>). Unknown id:
    /// `Api { status: 404, code: "resource_missing" }`.
    async fn retrieve_dispute(&self, id: &str) -> Result<Dispute, StripeError>;

    /// `POST /v1/payment_intents/{id}/capture`: captures the full authorized amount
    /// (<https://docs.stripe.com/api/payment_intents/capture>). Only from `requires_capture`;
    /// otherwise (including an expired authorization) Stripe answers 400
    /// `payment_intent_unexpected_state`.
    async fn capture_payment_intent(
        &self,
        id: &str,
        idempotency_key: &str,
    ) -> Result<PaymentIntent, StripeError>;

    /// `POST /v1/payment_intents/{id}/cancel` (<https://docs.stripe.com/api/payment_intents/cancel>):
    /// releases an authorization. From `succeeded` or `canceled` Stripe answers 400
    /// `payment_intent_unexpected_state` (refund instead).
    async fn cancel_payment_intent(
        &self,
        id: &str,
        idempotency_key: &str,
    ) -> Result<PaymentIntent, StripeError>;

    /// `POST /v1/refunds` with `payment_intent` and `metadata[k]=v`: refunds everything not yet
    /// refunded (<https://docs.stripe.com/api/refunds/create>). The intent must be `succeeded`.
    async fn create_refund(
        &self,
        payment_intent_id: &str,
        metadata: &[(String, String)],
        idempotency_key: &str,
    ) -> Result<Refund, StripeError>;
}

/// How to reach Stripe.
#[derive(Clone, Debug)]
pub struct StripeConfig {
    /// Scheme, host and port, no trailing path: `https://api.stripe.com` in production,
    /// `http://127.0.0.1:12111` for the simulator.
    pub api_base: String,
    /// `sk_live_…`/`sk_test_…` (or a restricted `rk_…` key).
    pub secret_key: SecretString,
    /// Whole-request timeout in milliseconds (connect + send + full body); must be > 0.
    /// A timed-out request may still have been applied: retry with the same idempotency key.
    pub timeout_ms: u64,
}

/// Stripe's own API host. A live key is only ever meant for it.
pub const STRIPE_API_HOST: &str = "api.stripe.com";

/// Whether `api_base` points at Stripe's own API (host [`STRIPE_API_HOST`], any scheme or
/// port), rather than a simulator or another host.
pub fn is_stripe_api(api_base: &str) -> bool {
    Url::parse(api_base.trim())
        .ok()
        .and_then(|u| u.host_str().map(|h| h.trim_end_matches('.').eq_ignore_ascii_case(STRIPE_API_HOST)))
        .unwrap_or(false)
}

/// The mode of a Stripe secret or restricted key, read from its prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyMode {
    /// `sk_live_…` / `rk_live_…`: moves real money.
    Live,
    /// `sk_test_…` / `rk_test_…`: Stripe's test mode.
    Test,
    /// Anything else (not a Stripe key).
    Unknown,
}

impl KeyMode {
    /// The mode of `key` (never echoes it).
    pub fn of(key: &str) -> Self {
        if key.starts_with("sk_live_") || key.starts_with("rk_live_") {
            Self::Live
        } else if key.starts_with("sk_test_") || key.starts_with("rk_test_") {
            Self::Test
        } else {
            Self::Unknown
        }
    }
}

/// Production [`PaymentGateway`]: a cheap-to-clone handle (one connection pool, `Arc` inside).
#[derive(Clone)]
pub struct StripeClient {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    http: reqwest::Client,
    base: Url,
    secret_key: SecretString,
    stripe_version: Option<String>,
    /// Bounds the requests in flight through the clients sharing it (`None`: unbounded).
    in_flight: Option<Arc<tokio::sync::Semaphore>>,
}

impl std::fmt::Debug for StripeClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StripeClient").field("api_base", &self.inner.base.as_str()).finish_non_exhaustive()
    }
}

/// Who signs a request: the server's secret key, or a browser's publishable key.
enum Auth<'a> {
    Secret,
    Publishable(&'a str),
}

impl StripeClient {
    /// Validates `cfg` and builds the HTTP client.
    ///
    /// Errors with [`StripeError::Config`] when `api_base` is not an absolute `http(s)` URL,
    /// the key is not an `sk_`/`rk_` key, or `timeout_ms` is 0.
    pub fn new(cfg: StripeConfig) -> Result<Self, StripeError> {
        let base = Url::parse(&cfg.api_base)
            .map_err(|e| StripeError::Config(format!("api_base is not a URL: {e}")))?;
        if !matches!(base.scheme(), "http" | "https") || base.cannot_be_a_base() {
            return Err(StripeError::Config("api_base must be an http(s) URL".into()));
        }
        let key = cfg.secret_key.expose_secret();
        if !(key.starts_with("sk_") || key.starts_with("rk_")) {
            return Err(StripeError::Config("secret_key must be an sk_… or rk_… key".into()));
        }
        if cfg.timeout_ms == 0 {
            return Err(StripeError::Config("timeout_ms must be > 0".into()));
        }
        let timeout = Duration::from_millis(cfg.timeout_ms);
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(5)))
            .user_agent(concat!("boxoffice-payments/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| StripeError::Config(format!("cannot build HTTP client: {e}")))?;
        Ok(Self {
            inner: Arc::new(Inner {
                http,
                base,
                secret_key: cfg.secret_key,
                stripe_version: None,
                in_flight: None,
            }),
        })
    }

    /// Pins the API version with a `Stripe-Version` header on every request
    /// (<https://docs.stripe.com/api/versioning>); without it the account default applies.
    pub fn with_stripe_version(mut self, version: impl Into<String>) -> Self {
        Arc::make_mut(&mut self.inner).stripe_version = Some(version.into());
        self
    }

    /// Lets at most `max` requests of the returned client and the clones made of it be in
    /// flight at once (0: no bound; clones made before this call are not bound by it); one
    /// more waits for a slot before it is sent, and its timeout starts when it is sent. Stripe limits an account's request rate and concurrency and answers 429
    /// beyond them (<https://docs.stripe.com/rate-limits>); one bound per process keeps a
    /// burst of payment commands (every lane's batch calling at once) inside a share of
    /// that instead of meeting it as errors.
    pub fn with_max_in_flight(mut self, max: usize) -> Self {
        Arc::make_mut(&mut self.inner).in_flight =
            (max > 0).then(|| Arc::new(tokio::sync::Semaphore::new(max)));
        self
    }

    /// Confirms as a browser would (Stripe.js): `POST /v1/payment_intents/{id}/confirm` with
    /// `payment_method` (e.g. `pm_card_visa`) and `client_secret`, authorized by the
    /// *publishable* key (`pk_…`), no idempotency key
    /// (<https://docs.stripe.com/api/payment_intents/confirm>).
    ///
    /// With `capture_method=manual` a good card leaves the intent in `requires_capture`.
    /// A decline is `Api { status: 402, error_type: "card_error", code: "card_declined",
    /// decline_code, .. }`. Used by the load generator and tests; the server never confirms.
    pub async fn confirm_with_client_secret(
        &self,
        publishable_key: &str,
        id: &str,
        client_secret: &str,
        payment_method: &str,
    ) -> Result<PaymentIntent, StripeError> {
        if !publishable_key.starts_with("pk_") {
            return Err(StripeError::Config("publishable_key must be a pk_… key".into()));
        }
        let form = [
            ("payment_method".to_owned(), payment_method.to_owned()),
            ("client_secret".to_owned(), client_secret.to_owned()),
        ];
        self.send(
            Method::POST,
            &["payment_intents", id, "confirm"],
            Auth::Publishable(publishable_key),
            &[],
            Some(&form),
            None,
        )
        .await
    }

    /// Every PaymentIntent created at or after `created_gte_unix` (unix seconds), newest first,
    /// fetched with `GET /v1/payment_intents?created[gte]=…&limit=100&starting_after=…` until
    /// `has_more` is false (<https://docs.stripe.com/api/pagination/auto>). For reconciliation.
    pub async fn list_payment_intents(
        &self,
        created_gte_unix: i64,
    ) -> Result<Vec<PaymentIntent>, StripeError> {
        let window = CreatedWindow { gte: Some(created_gte_unix), lte: None };
        paginate(
            |after| async move {
                let query = window.page_query(LIST_PAGE_LIMIT, after.as_deref());
                self.send(Method::GET, &["payment_intents"], Auth::Secret, &query, None, None).await
            },
            |pi: &PaymentIntent| &pi.id,
        )
        .await
    }

    /// Every PaymentIntent created inside `window`, newest first, each with its latest charge
    /// expanded (`expand[]=data.latest_charge`: refunds and the capture deadline live on the
    /// charge). Pages of 100 are fetched with `starting_after` until `has_more` is false;
    /// intents created while paging are newer than the cursor and so never shift a page. For
    /// `boxoffice audit` and `boxoffice reconcile`. Errors: the first failed page's error.
    pub async fn list_payment_intents_with_charges(
        &self,
        window: CreatedWindow,
    ) -> Result<Vec<IntentWithCharge>, StripeError> {
        paginate(
            |after| async move {
                let mut query = window.page_query(LIST_PAGE_LIMIT, after.as_deref());
                query.push(("expand[]".to_owned(), "data.latest_charge".to_owned()));
                self.send(Method::GET, &["payment_intents"], Auth::Secret, &query, None, None).await
            },
            |i: &IntentWithCharge| &i.intent.id,
        )
        .await
    }

    /// The disputes of `payment_intent_id`, newest first (`GET /v1/disputes?payment_intent=…&limit=100`,
    /// <https://docs.stripe.com/api/disputes/list>). One page: a charge is disputed at most once,
    /// and an inquiry becomes the dispute itself. For `boxoffice reconcile`.
    pub async fn list_disputes_of(&self, payment_intent_id: &str) -> Result<Vec<Dispute>, StripeError> {
        let query = [
            ("payment_intent".to_owned(), payment_intent_id.to_owned()),
            ("limit".to_owned(), LIST_PAGE_LIMIT.to_string()),
        ];
        let page: crate::types::List<Dispute> =
            self.send(Method::GET, &["disputes"], Auth::Secret, &query, None, None).await?;
        Ok(page.data)
    }

    /// Sends one request and decodes a 2xx JSON body as `T`; non-2xx becomes
    /// [`StripeError::Api`]. `path` segments after `/v1` are percent-encoded individually.
    async fn send<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &[&str],
        auth: Auth<'_>,
        query: &[(String, String)],
        form: Option<&[(String, String)]>,
        idempotency_key: Option<&str>,
    ) -> Result<T, StripeError> {
        let inner = &*self.inner;
        let mut url = inner.base.clone();
        url.path_segments_mut()
            .map_err(|()| StripeError::Config("api_base cannot be a base URL".into()))?
            .pop_if_empty()
            .push("v1")
            .extend(path);
        if !query.is_empty() {
            url.query_pairs_mut().extend_pairs(query);
        }
        let log_path = url.path().to_owned();
        let mut req = inner.http.request(method.clone(), url);
        req = match auth {
            Auth::Secret => req.bearer_auth(inner.secret_key.expose_secret()),
            Auth::Publishable(pk) => req.bearer_auth(pk),
        };
        if let Some(version) = &inner.stripe_version {
            req = req.header("Stripe-Version", version);
        }
        if let Some(key) = idempotency_key {
            if key.is_empty() || key.len() > MAX_IDEMPOTENCY_KEY_LEN {
                return Err(StripeError::Config("idempotency key must be 1..=255 characters".into()));
            }
            req = req.header("Idempotency-Key", key);
        }
        if let Some(form) = form {
            let body = serde_urlencoded::to_string(form)
                .map_err(|e| StripeError::Config(format!("cannot encode form: {e}")))?;
            req = req.header(reqwest::header::CONTENT_TYPE, "application/x-www-form-urlencoded").body(body);
        }

        // Held until the answer's body is read; the semaphore is never closed.
        let _slot = match &inner.in_flight {
            Some(s) => Some(s.acquire().await.map_err(|_| StripeError::Config("client closed".into()))?),
            None => None,
        };
        let started = Instant::now();
        let outcome = async {
            let resp = req.send().await.map_err(StripeError::Transport)?;
            let status = resp.status();
            let request_id =
                resp.headers().get("request-id").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
            let body = resp.bytes().await.map_err(StripeError::Transport)?;
            Ok::<_, StripeError>((status, request_id, body))
        }
        .await;
        let duration_ms = started.elapsed().as_millis() as u64;
        let (status, request_id, body) = match outcome {
            Ok(ok) => ok,
            Err(e) => {
                tracing::warn!(http.method = %method, stripe.path = %log_path, duration_ms, error = %e, "stripe request got no answer");
                return Err(e);
            }
        };
        tracing::debug!(
            http.method = %method,
            stripe.path = %log_path,
            http.status = status.as_u16(),
            stripe.request_id = %request_id,
            duration_ms,
            "stripe request"
        );
        if status.is_success() {
            serde_json::from_slice(&body).map_err(StripeError::Decode)
        } else {
            Err(StripeError::from_response(status.as_u16(), &body))
        }
    }
}

/// Follows Stripe's cursor pagination: asks `fetch_page` for the first page (`None`), then
/// for the page after the last item's id (`id_of`), until a page says `has_more: false` or
/// comes back empty. A page whose last id repeats the previous cursor also ends the walk, so
/// a misbehaving server cannot loop us forever. Errors: the first page that failed.
pub(crate) async fn paginate<T, F, Fut>(
    mut fetch_page: F,
    id_of: impl Fn(&T) -> &str,
) -> Result<Vec<T>, StripeError>
where
    F: FnMut(Option<String>) -> Fut,
    Fut: std::future::Future<Output = Result<List<T>, StripeError>>,
{
    let mut all: Vec<T> = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let page = fetch_page(cursor.clone()).await?;
        let next = page.data.last().map(|t| id_of(t).to_owned());
        let done = !page.has_more || next.is_none() || next == cursor;
        all.extend(page.data);
        if done {
            return Ok(all);
        }
        cursor = next;
    }
}

#[async_trait::async_trait]
impl PaymentGateway for StripeClient {
    async fn create_payment_intent(
        &self,
        req: &CreatePaymentIntent,
        idempotency_key: &str,
    ) -> Result<PaymentIntent, StripeError> {
        let form = req.to_form();
        self.send(Method::POST, &["payment_intents"], Auth::Secret, &[], Some(&form), Some(idempotency_key))
            .await
    }

    async fn retrieve_payment_intent(&self, id: &str) -> Result<PaymentIntent, StripeError> {
        self.send(Method::GET, &["payment_intents", id], Auth::Secret, &[], None, None).await
    }

    async fn retrieve_charge(&self, id: &str) -> Result<Charge, StripeError> {
        self.send(Method::GET, &["charges", id], Auth::Secret, &[], None, None).await
    }

    async fn retrieve_dispute(&self, id: &str) -> Result<Dispute, StripeError> {
        self.send(Method::GET, &["disputes", id], Auth::Secret, &[], None, None).await
    }

    async fn capture_payment_intent(
        &self,
        id: &str,
        idempotency_key: &str,
    ) -> Result<PaymentIntent, StripeError> {
        self.send(
            Method::POST,
            &["payment_intents", id, "capture"],
            Auth::Secret,
            &[],
            Some(&[]),
            Some(idempotency_key),
        )
        .await
    }

    async fn cancel_payment_intent(
        &self,
        id: &str,
        idempotency_key: &str,
    ) -> Result<PaymentIntent, StripeError> {
        self.send(
            Method::POST,
            &["payment_intents", id, "cancel"],
            Auth::Secret,
            &[],
            Some(&[]),
            Some(idempotency_key),
        )
        .await
    }

    async fn create_refund(
        &self,
        payment_intent_id: &str,
        metadata: &[(String, String)],
        idempotency_key: &str,
    ) -> Result<Refund, StripeError> {
        let mut form = vec![("payment_intent".to_owned(), payment_intent_id.to_owned())];
        push_metadata(&mut form, metadata);
        self.send(Method::POST, &["refunds"], Auth::Secret, &[], Some(&form), Some(idempotency_key)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(base: &str, key: &str, timeout_ms: u64) -> StripeConfig {
        StripeConfig { api_base: base.into(), secret_key: SecretString::from(key), timeout_ms }
    }

    /// A newest-first listing of `ids` (ids are their creation times) answered like Stripe:
    /// window filter, `limit`, `starting_after`; records every cursor it was asked for.
    fn fake_pages(
        ids: Vec<i64>,
        window: CreatedWindow,
        limit: usize,
        cursors: &std::sync::Mutex<Vec<Option<String>>>,
    ) -> impl FnMut(Option<String>) -> std::future::Ready<Result<List<String>, StripeError>> + '_ {
        move |after| {
            cursors.lock().unwrap().push(after.clone());
            let mut newest_first: Vec<i64> = ids.clone();
            newest_first.sort_unstable_by(|a, b| b.cmp(a));
            let start = match &after {
                Some(a) => newest_first.iter().position(|t| t.to_string() == *a).map_or(0, |i| i + 1),
                None => 0,
            };
            let matching: Vec<String> = newest_first[start..]
                .iter()
                .filter(|t| window.gte.is_none_or(|g| **t >= g) && window.lte.is_none_or(|l| **t <= l))
                .map(i64::to_string)
                .collect();
            let data: Vec<String> = matching.iter().take(limit).cloned().collect();
            std::future::ready(Ok(List { has_more: matching.len() > data.len(), data }))
        }
    }

    #[tokio::test]
    async fn paginate_walks_every_page_of_the_window_once() {
        let ids: Vec<i64> = (1..=250).collect();
        let window = CreatedWindow { gte: Some(20), lte: Some(230) };
        let cursors = std::sync::Mutex::new(Vec::new());
        let got = paginate(fake_pages(ids, window, 100, &cursors), |s: &String| s.as_str()).await.unwrap();
        let want: Vec<String> = (20..=230).rev().map(|t: i64| t.to_string()).collect();
        assert_eq!(got, want, "newest first, window inclusive at both ends, no repeats");
        // 211 items in pages of 100: three requests, each after the previous page's last id.
        assert_eq!(*cursors.lock().unwrap(), vec![None, Some("131".into()), Some("31".into())]);
    }

    #[tokio::test]
    async fn paginate_stops_on_an_empty_window_and_on_a_stuck_cursor() {
        let cursors = std::sync::Mutex::new(Vec::new());
        let window = CreatedWindow { gte: Some(900), lte: None };
        let got = paginate(fake_pages((1..=10).collect(), window, 3, &cursors), |s: &String| s.as_str())
            .await
            .unwrap();
        assert!(got.is_empty());
        assert_eq!(cursors.lock().unwrap().len(), 1);
        // A server that keeps answering the same page with has_more: true.
        let mut calls = 0;
        let got = paginate(
            |_| {
                calls += 1;
                std::future::ready(Ok::<_, StripeError>(List {
                    data: vec!["pi_same".to_owned()],
                    has_more: true,
                }))
            },
            |s: &String| s.as_str(),
        )
        .await
        .unwrap();
        assert_eq!((got.len(), calls), (2, 2));
    }

    #[test]
    fn page_query_carries_the_window_and_the_cursor() {
        let w = CreatedWindow { gte: Some(10), lte: Some(20) };
        let q = w.page_query(100, Some("pi_x"));
        let q: Vec<(&str, &str)> = q.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        assert_eq!(
            q,
            [("created[gte]", "10"), ("created[lte]", "20"), ("limit", "100"), ("starting_after", "pi_x")]
        );
        assert_eq!(CreatedWindow::default().page_query(5, None), vec![("limit".to_owned(), "5".to_owned())]);
    }

    #[test]
    fn listed_intent_with_expanded_charge_decodes() {
        let v = serde_json::json!({
            "id": "pi_1", "object": "payment_intent", "status": "succeeded", "amount": 100,
            "amount_capturable": 0, "amount_received": 100, "currency": "usd", "capture_method": "manual",
            "client_secret": "pi_1_secret_x", "metadata": {"order_id": "o1"}, "created": 5,
            "latest_charge": {"id": "ch_1", "object": "charge", "amount": 100, "amount_captured": 100,
                "amount_refunded": 40, "captured": true, "status": "succeeded",
                "payment_method_details": {"type": "card", "card": {"capture_before": 99}}}
        });
        let l: IntentWithCharge = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(l.intent.latest_charge.as_deref(), Some("ch_1"));
        assert_eq!((l.amount_refunded(), l.order_id()), (40, Some("o1")));
        assert_eq!(l.charge.as_ref().unwrap().capture_before(), Some(99));
        let mut plain = v;
        plain["latest_charge"] = "ch_2".into();
        let l: IntentWithCharge = serde_json::from_value(plain).unwrap();
        assert_eq!((l.intent.latest_charge.as_deref(), l.charge), (Some("ch_2"), None));
    }

    #[test]
    fn stripe_base_and_key_mode_are_recognized() {
        for base in ["https://api.stripe.com", "https://API.stripe.com:443/", "http://api.stripe.com."] {
            assert!(is_stripe_api(base), "{base}");
        }
        for base in ["http://127.0.0.1:12111", "https://api.stripe.com.evil.test", "", "api.stripe.com"] {
            assert!(!is_stripe_api(base), "{base}");
        }
        assert_eq!(KeyMode::of("sk_live_x"), KeyMode::Live);
        assert_eq!(KeyMode::of("rk_live_x"), KeyMode::Live);
        assert_eq!(KeyMode::of("sk_test_x"), KeyMode::Test);
        assert_eq!(KeyMode::of("rk_test_x"), KeyMode::Test);
        assert_eq!(KeyMode::of("pk_live_x"), KeyMode::Unknown);
    }

    #[test]
    fn new_validates_config_without_echoing_the_key() {
        assert!(StripeClient::new(cfg("http://127.0.0.1:1", "sk_test_x", 1000)).is_ok());
        assert!(StripeClient::new(cfg("ftp://x", "sk_test_x", 1000)).is_err());
        assert!(StripeClient::new(cfg("http://127.0.0.1:1", "sk_test_x", 0)).is_err());
        let err = StripeClient::new(cfg("http://127.0.0.1:1", "pk_test_leaky", 1000)).unwrap_err();
        assert!(!err.to_string().contains("leaky"));
        let dbg = format!("{:?}", StripeClient::new(cfg("http://127.0.0.1:1", "sk_test_hidden", 1)).unwrap());
        assert!(!dbg.contains("hidden"), "{dbg}");
    }
}
