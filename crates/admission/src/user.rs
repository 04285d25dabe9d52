//! Buyer bearer tokens (`Authorization: Bearer <JWT>`), as an identity provider issues them.
//!
//! [`UserTokens`] verifies a token's signature, then `exp`/`nbf` (with a small leeway), the
//! configured issuer (`iss`) and audience (`aud`), and that the token was not issued for
//! longer than a maximum lifetime (`exp − iat`). Two kinds of key:
//!
//! - **The identity provider's public keys** ([`Jwks`]): RS256, ES256 (P-256) or EdDSA
//!   (Ed25519) keys from a JWKS document (a file or an `https` URL), selected by the token's
//!   `kid`. The key set is cached; once it is older than `refresh_after` the next token
//!   triggers a background re-read (the request is served from the cached set), and a token
//!   naming an unknown `kid` triggers an immediate re-read — at most once per
//!   `min_refresh_interval`, so a stream of forged `kid`s cannot make the API hammer the
//!   provider. A failed re-read keeps the previous set; a key removed from the document stops
//!   verifying at the next successful re-read. Symmetric (`oct`) keys, encryption keys and
//!   other algorithms in the document are skipped, never trusted.
//! - **A shared HS256 secret**, development only: it lets the drills and tests mint tokens
//!   ([`UserTokens::issue`]). A verifier built without it refuses HS256 tokens.
//!
//! The user id is the `sub` claim when it is a UUID, else a UUID v5 derived from `iss` and
//! `sub` (identity providers' subjects are opaque strings), so one provider account is one
//! buyer. Every refusal names its reason ([`UserTokenError`], → 401); keys are never logged.

use boxoffice_domain::UserId;
use chrono::Utc;
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, KeyAlgorithm, PublicKeyUse};
use jsonwebtoken::{
    decode, decode_header, encode, errors::ErrorKind, Algorithm, DecodingKey, EncodingKey, Header, Validation,
};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};
use uuid::Uuid;

/// Namespace of the user ids derived from a non-UUID `sub` (UUID v5 of `iss` + `sub`).
pub const USER_ID_NAMESPACE: Uuid = Uuid::from_u128(0x6d1f_7a4e_2b3c_5d8e_9f01_a2b3_c4d5_e6f7);

/// Largest JWKS document read, bytes.
const MAX_JWKS_BYTES: usize = 1 << 20;

/// Claims of a user bearer token minted with the development HS256 secret.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UserClaims {
    /// The user id.
    pub sub: Uuid,
    /// Issued at, unix seconds.
    pub iat: i64,
    /// Expiry, unix seconds.
    pub exp: i64,
    /// Issuer, when the policy names one.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub iss: Option<String>,
    /// Audience, when the policy names one.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub aud: Option<String>,
}

/// The claims every verified token is read for (`sub` as the provider spells it).
#[derive(Deserialize)]
struct VerifiedClaims {
    sub: String,
    #[serde(default)]
    iat: Option<i64>,
    exp: i64,
    #[serde(default)]
    iss: Option<String>,
}

/// Why a user token was refused (→ 401 with this text as the detail).
#[derive(Debug, thiserror::Error, PartialEq, Eq, Clone)]
pub enum UserTokenError {
    /// Not a JWT at all.
    #[error("the bearer token is not a well-formed JWT")]
    Malformed,
    /// Bad signature, a missing required claim, or a key of another algorithm than the token's.
    #[error("the bearer token is invalid")]
    Invalid,
    /// Past `exp` (beyond the leeway).
    #[error("the bearer token has expired")]
    Expired,
    /// `nbf` or `iat` in the future (beyond the leeway).
    #[error("the bearer token is not valid yet")]
    NotYetValid,
    /// An algorithm this verifier does not accept (HS256 without the development secret,
    /// or anything but RS256, ES256 and EdDSA).
    #[error("bearer tokens signed with {0:?} are not accepted")]
    AlgorithmNotAllowed(Algorithm),
    /// No `kid`, or one the identity provider's key set does not hold (even after a re-read).
    #[error("the bearer token was signed by an unknown key")]
    UnknownKey,
    /// `iss` is not the configured issuer.
    #[error("the bearer token was issued by another issuer")]
    WrongIssuer,
    /// `aud` does not name the configured audience.
    #[error("the bearer token is for another audience")]
    WrongAudience,
    /// No `iat`, or `exp − iat` above the maximum lifetime.
    #[error("the bearer token lives longer than {max_s} s or has no iat")]
    LifetimeTooLong {
        /// The maximum lifetime, seconds.
        max_s: i64,
    },
}

/// What every accepted token must satisfy besides its signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserTokenPolicy {
    /// Required `iss` (`None`: not checked; production requires one).
    pub issuer: Option<String>,
    /// Required member of `aud` (`None`: a token carrying `aud` is refused; production
    /// requires one).
    pub audience: Option<String>,
    /// Longest accepted `exp − iat`, seconds (`iat` is then required).
    pub max_lifetime_s: i64,
    /// Clock skew allowed on `exp`, `nbf` and `iat`, seconds.
    pub leeway_s: u64,
}

impl Default for UserTokenPolicy {
    fn default() -> Self {
        Self { issuer: None, audience: None, max_lifetime_s: 7_200, leeway_s: 30 }
    }
}

/// Where the identity provider's JWKS document is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JwksSource {
    /// A local file (e.g. mounted from a secret store or written by a sidecar).
    File(PathBuf),
    /// An `https` URL (the provider's `jwks_uri`).
    Url(String),
}

/// How the key set is read and kept fresh.
#[derive(Debug, Clone)]
pub struct JwksSettings {
    /// The document.
    pub source: JwksSource,
    /// A key set older than this is re-read in the background on the next token.
    pub refresh_after: Duration,
    /// Re-reads happen at most this often (an unknown `kid` included).
    pub min_refresh_interval: Duration,
    /// Bound of one read.
    pub timeout: Duration,
}

impl JwksSettings {
    /// `source` with the defaults: re-read after 5 minutes, at most every 30 s, 5 s per read.
    pub fn new(source: JwksSource) -> Self {
        Self {
            source,
            refresh_after: Duration::from_secs(300),
            min_refresh_interval: Duration::from_secs(30),
            timeout: Duration::from_secs(5),
        }
    }
}

/// Why the key set could not be read. Never carries key material.
#[derive(Debug, thiserror::Error)]
pub enum JwksError {
    /// The file could not be read.
    #[error("reading the JWKS file {path:?}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The URL could not be fetched.
    #[error("fetching the JWKS from {url}")]
    Fetch {
        /// The URL.
        url: String,
        /// The cause.
        source: reqwest::Error,
    },
    /// The HTTP client could not be built (TLS backend).
    #[error("building the JWKS HTTP client")]
    Client(#[source] reqwest::Error),
    /// The URL answered with a non-success status.
    #[error("fetching the JWKS from {url}: HTTP {status}")]
    Status {
        /// The URL.
        url: String,
        /// The status.
        status: u16,
    },
    /// Larger than the bound ([`MAX_JWKS_BYTES`], 1 MiB).
    #[error("the JWKS document is larger than 1 MiB")]
    TooLarge,
    /// Not a JSON object with a `keys` array.
    #[error("the JWKS document is not a JSON key set")]
    Parse(#[source] serde_json::Error),
    /// No key the verifier accepts (RS256, ES256 on P-256, EdDSA on Ed25519, with a `kid`).
    #[error("the JWKS document holds no usable signing key ({skipped} skipped)")]
    NoUsableKeys {
        /// Keys skipped.
        skipped: usize,
    },
}

#[derive(Clone)]
struct VerifyKey {
    alg: Algorithm,
    key: DecodingKey,
}

struct KeySet {
    keys: HashMap<String, VerifyKey>,
    read_at: Instant,
}

struct JwksInner {
    settings: JwksSettings,
    http: reqwest::Client,
    set: RwLock<Arc<KeySet>>,
    /// Held while re-reading; holds when the last re-read was attempted.
    refresh: Arc<tokio::sync::Mutex<Instant>>,
}

/// The identity provider's signing keys, cached and re-read as described in the module docs.
/// Cheap to clone.
#[derive(Clone)]
pub struct Jwks {
    inner: Arc<JwksInner>,
}

impl std::fmt::Debug for Jwks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jwks")
            .field("source", &self.inner.settings.source)
            .field("kids", &self.kids())
            .finish()
    }
}

impl Jwks {
    /// Reads the key set once; fails when it cannot be read or holds no usable key (a
    /// verifier that starts without keys would refuse every buyer).
    ///
    /// # Errors
    /// [`JwksError`].
    pub async fn load(settings: JwksSettings) -> Result<Self, JwksError> {
        let http = reqwest::Client::builder().timeout(settings.timeout).build().map_err(JwksError::Client)?;
        let keys = read(&settings, &http).await?;
        Ok(Self {
            inner: Arc::new(JwksInner {
                settings,
                http,
                set: RwLock::new(Arc::new(KeySet { keys, read_at: Instant::now() })),
                refresh: Arc::new(tokio::sync::Mutex::new(Instant::now())),
            }),
        })
    }

    /// The `kid`s of the current set, sorted.
    pub fn kids(&self) -> Vec<String> {
        let mut kids: Vec<String> = self.current().keys.keys().cloned().collect();
        kids.sort_unstable();
        kids
    }

    fn current(&self) -> Arc<KeySet> {
        self.inner.set.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn get(&self, kid: &str) -> Option<VerifyKey> {
        self.current().keys.get(kid).cloned()
    }

    /// Re-reads the set now, whatever the rate limit; keeps the old set on failure.
    ///
    /// # Errors
    /// [`JwksError`].
    pub async fn refresh(&self) -> Result<usize, JwksError> {
        let mut last = self.inner.refresh.lock().await;
        *last = Instant::now();
        self.reread("forced").await
    }

    async fn reread(&self, trigger: &'static str) -> Result<usize, JwksError> {
        let result = read(&self.inner.settings, &self.inner.http).await;
        let outcome = match &result {
            Ok(keys) => {
                let n = keys.len();
                *self.inner.set.write().unwrap_or_else(|e| e.into_inner()) =
                    Arc::new(KeySet { keys: keys.clone(), read_at: Instant::now() });
                metrics::gauge!("boxoffice_user_jwks_keys").set(n as f64);
                "ok"
            }
            Err(e) => {
                tracing::warn!(error = %e, trigger, "re-reading the identity provider's JWKS failed; keeping the cached keys");
                "error"
            }
        };
        metrics::counter!("boxoffice_user_jwks_refreshes_total", "trigger" => trigger, "outcome" => outcome)
            .increment(1);
        result.map(|k| k.len())
    }

    /// After an unknown `kid`: re-reads unless another re-read already brought it or the
    /// last attempt was less than `min_refresh_interval` ago. Whether `kid` is known now.
    async fn refresh_for(&self, kid: &str) -> bool {
        let mut last = self.inner.refresh.lock().await;
        if self.get(kid).is_some() {
            return true;
        }
        if last.elapsed() < self.inner.settings.min_refresh_interval {
            metrics::counter!("boxoffice_user_jwks_refreshes_total", "trigger" => "unknown_kid", "outcome" => "rate_limited")
                .increment(1);
            return false;
        }
        *last = Instant::now();
        let _ = self.reread("unknown_kid").await;
        self.get(kid).is_some()
    }

    /// Starts a background re-read when the set is older than `refresh_after` (and no
    /// re-read is running or was attempted within `min_refresh_interval`). Needs a tokio
    /// runtime; without one it does nothing.
    fn refresh_if_stale(&self) {
        let s = &self.inner.settings;
        if self.current().read_at.elapsed() < s.refresh_after {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else { return };
        let Ok(mut last) = self.inner.refresh.clone().try_lock_owned() else { return };
        if last.elapsed() < s.min_refresh_interval {
            return;
        }
        *last = Instant::now();
        let this = self.clone();
        handle.spawn(async move {
            let _held = last;
            let _ = this.reread("interval").await;
        });
    }
}

/// Reads and parses the document of `settings`.
async fn read(
    settings: &JwksSettings,
    http: &reqwest::Client,
) -> Result<HashMap<String, VerifyKey>, JwksError> {
    let body = match &settings.source {
        JwksSource::File(path) => {
            let read =
                tokio::time::timeout(settings.timeout, tokio::fs::read(path)).await.unwrap_or_else(|_| {
                    Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "reading took too long"))
                });
            read.map_err(|source| JwksError::Read { path: path.clone(), source })?
        }
        JwksSource::Url(url) => {
            let fetch = |source| JwksError::Fetch { url: url.clone(), source };
            let mut resp = http.get(url).header("accept", "application/json").send().await.map_err(fetch)?;
            if !resp.status().is_success() {
                return Err(JwksError::Status { url: url.clone(), status: resp.status().as_u16() });
            }
            let mut body = Vec::new();
            while let Some(chunk) = resp.chunk().await.map_err(fetch)? {
                if body.len() + chunk.len() > MAX_JWKS_BYTES {
                    return Err(JwksError::TooLarge);
                }
                body.extend_from_slice(&chunk);
            }
            body
        }
    };
    if body.len() > MAX_JWKS_BYTES {
        return Err(JwksError::TooLarge);
    }
    parse_key_set(&body)
}

/// The usable keys of a JWKS document, by `kid`. A key that does not parse, has no `kid`, is
/// for encryption, is symmetric or is for another algorithm is skipped.
fn parse_key_set(body: &[u8]) -> Result<HashMap<String, VerifyKey>, JwksError> {
    #[derive(Deserialize)]
    struct Raw {
        keys: Vec<serde_json::Value>,
    }
    let raw: Raw = serde_json::from_slice(body).map_err(JwksError::Parse)?;
    let mut keys = HashMap::new();
    let mut skipped = 0;
    for value in raw.keys {
        match serde_json::from_value::<Jwk>(value).ok().and_then(|jwk| usable(&jwk)) {
            Some((kid, key)) => {
                keys.insert(kid, key);
            }
            None => skipped += 1,
        }
    }
    if keys.is_empty() {
        return Err(JwksError::NoUsableKeys { skipped });
    }
    Ok(keys)
}

fn usable(jwk: &Jwk) -> Option<(String, VerifyKey)> {
    let kid = jwk.common.key_id.clone().filter(|k| !k.is_empty())?;
    if matches!(jwk.common.public_key_use, Some(PublicKeyUse::Encryption | PublicKeyUse::Other(_))) {
        return None;
    }
    let declared = jwk.common.key_algorithm;
    let alg = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) if matches!(declared, None | Some(KeyAlgorithm::RS256)) => {
            Algorithm::RS256
        }
        AlgorithmParameters::EllipticCurve(p)
            if p.curve == EllipticCurve::P256 && matches!(declared, None | Some(KeyAlgorithm::ES256)) =>
        {
            Algorithm::ES256
        }
        AlgorithmParameters::OctetKeyPair(p)
            if p.curve == EllipticCurve::Ed25519 && matches!(declared, None | Some(KeyAlgorithm::EdDSA)) =>
        {
            Algorithm::EdDSA
        }
        _ => return None,
    };
    let key = DecodingKey::from_jwk(jwk).ok()?;
    Some((kid, VerifyKey { alg, key }))
}

struct Hs256 {
    enc: EncodingKey,
    dec: DecodingKey,
}

struct Inner {
    policy: UserTokenPolicy,
    hs256: Option<Hs256>,
    jwks: Option<Jwks>,
}

/// Verifies buyer bearer tokens (and, with the development secret, issues them). Cheap to
/// clone.
#[derive(Clone)]
pub struct UserTokens {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for UserTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserTokens")
            .field("policy", &self.inner.policy)
            .field("hs256", &self.inner.hs256.is_some())
            .field("jwks", &self.inner.jwks)
            .finish()
    }
}

impl UserTokens {
    /// HS256 with a shared secret and the default policy (development: drills and tests).
    pub fn new(secret: &[u8]) -> Self {
        Self::with(UserTokenPolicy::default(), Some(secret), None)
    }

    /// A verifier with `policy`, accepting HS256 only when `hs256_secret` is given and the
    /// identity provider's keys when `jwks` is.
    pub fn with(policy: UserTokenPolicy, hs256_secret: Option<&[u8]>, jwks: Option<Jwks>) -> Self {
        let hs256 = hs256_secret
            .map(|s| Hs256 { enc: EncodingKey::from_secret(s), dec: DecodingKey::from_secret(s) });
        Self { inner: Arc::new(Inner { policy, hs256, jwks }) }
    }

    /// The policy.
    pub fn policy(&self) -> &UserTokenPolicy {
        &self.inner.policy
    }

    /// Whether HS256 tokens are accepted (and [`UserTokens::issue`] works).
    pub fn accepts_hs256(&self) -> bool {
        self.inner.hs256.is_some()
    }

    /// An HS256 token for `user` valid for `ttl_s` seconds, with the policy's `iss`/`aud`.
    ///
    /// # Panics
    /// Without the development secret (see [`UserTokens::accepts_hs256`]): production
    /// tokens come from the identity provider.
    pub fn issue(&self, user: UserId, ttl_s: i64) -> String {
        let hs = self.inner.hs256.as_ref().expect("issuing user tokens needs the development HS256 secret");
        let now = Utc::now().timestamp();
        let p = &self.inner.policy;
        let claims = UserClaims {
            sub: user.0,
            iat: now,
            exp: now + ttl_s,
            iss: p.issuer.clone(),
            aud: p.audience.clone(),
        };
        encode(&Header::new(Algorithm::HS256), &claims, &hs.enc).expect("HS256 signing cannot fail")
    }

    /// The user of a valid token, with the keys cached now (no network: an unknown `kid` is
    /// refused; see [`UserTokens::authenticate`]).
    ///
    /// # Errors
    /// The first failing check, as a [`UserTokenError`].
    pub fn verify(&self, token: &str) -> Result<UserId, UserTokenError> {
        self.check(token)
    }

    /// Like [`UserTokens::verify`], but a token naming a `kid` the cached set lacks first
    /// triggers a (rate-limited) re-read of the identity provider's keys.
    ///
    /// # Errors
    /// The first failing check, as a [`UserTokenError`].
    pub async fn authenticate(&self, token: &str) -> Result<UserId, UserTokenError> {
        match self.check(token) {
            Err(UserTokenError::UnknownKey) => {
                let kid = decode_header(token).ok().and_then(|h| h.kid);
                match (&self.inner.jwks, kid) {
                    (Some(jwks), Some(kid)) if jwks.refresh_for(&kid).await => self.check(token),
                    _ => Err(UserTokenError::UnknownKey),
                }
            }
            other => other,
        }
    }

    fn check(&self, token: &str) -> Result<UserId, UserTokenError> {
        let header = decode_header(token).map_err(|_| UserTokenError::Malformed)?;
        let key = match header.alg {
            Algorithm::HS256 => match &self.inner.hs256 {
                Some(h) => h.dec.clone(),
                None => return Err(UserTokenError::AlgorithmNotAllowed(Algorithm::HS256)),
            },
            Algorithm::RS256 | Algorithm::ES256 | Algorithm::EdDSA => {
                let jwks = self.inner.jwks.as_ref().ok_or(UserTokenError::AlgorithmNotAllowed(header.alg))?;
                jwks.refresh_if_stale();
                let k =
                    header.kid.as_deref().and_then(|kid| jwks.get(kid)).ok_or(UserTokenError::UnknownKey)?;
                if k.alg != header.alg {
                    return Err(UserTokenError::Invalid);
                }
                k.key
            }
            other => return Err(UserTokenError::AlgorithmNotAllowed(other)),
        };
        let p = &self.inner.policy;
        let mut v = Validation::new(header.alg);
        v.leeway = p.leeway_s;
        v.validate_nbf = true;
        let mut required = vec!["exp", "sub"];
        if let Some(iss) = &p.issuer {
            v.set_issuer(&[iss]);
            required.push("iss");
        }
        match &p.audience {
            Some(aud) => {
                v.set_audience(&[aud]);
                required.push("aud");
            }
            // RFC 7519 §4.1.3: a token naming audiences must name us; with none configured,
            // a token that names any audience was meant for someone else.
            None => v.validate_aud = true,
        }
        v.set_required_spec_claims(&required);
        let claims = decode::<VerifiedClaims>(token, &key, &v)
            .map_err(|e| match e.kind() {
                ErrorKind::ExpiredSignature => UserTokenError::Expired,
                ErrorKind::ImmatureSignature => UserTokenError::NotYetValid,
                ErrorKind::InvalidIssuer => UserTokenError::WrongIssuer,
                ErrorKind::InvalidAudience => UserTokenError::WrongAudience,
                ErrorKind::InvalidAlgorithm => UserTokenError::AlgorithmNotAllowed(header.alg),
                _ => UserTokenError::Invalid,
            })?
            .claims;
        if p.max_lifetime_s > 0 {
            let iat = claims.iat.ok_or(UserTokenError::LifetimeTooLong { max_s: p.max_lifetime_s })?;
            if iat > Utc::now().timestamp() + p.leeway_s as i64 {
                return Err(UserTokenError::NotYetValid);
            }
            if claims.exp.saturating_sub(iat) > p.max_lifetime_s {
                return Err(UserTokenError::LifetimeTooLong { max_s: p.max_lifetime_s });
            }
        }
        // An empty subject (or the nil UUID) names no account: every such token would be one
        // shared buyer, with one shared cap.
        if claims.sub.trim().is_empty() || Uuid::parse_str(&claims.sub).is_ok_and(|u| u.is_nil()) {
            return Err(UserTokenError::Invalid);
        }
        Ok(user_id(claims.iss.as_deref(), &claims.sub))
    }
}

/// The buyer of `sub`: the UUID itself, or a UUID v5 of `iss` and `sub`.
pub fn user_id(iss: Option<&str>, sub: &str) -> UserId {
    match Uuid::parse_str(sub) {
        Ok(u) => UserId(u),
        Err(_) => {
            UserId(Uuid::new_v5(&USER_ID_NAMESPACE, format!("{}\n{sub}", iss.unwrap_or_default()).as_bytes()))
        }
    }
}

#[cfg(test)]
mod tests;
