//! The RSA and P-256 keys in `testdata/` are test-only keys generated for these tests; the
//! Ed25519 keys are derived from fixed seeds here.

use super::*;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use ed25519_dalek::pkcs8::EncodePrivateKey;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

const ISS: &str = "https://id.example.test/";
const AUD: &str = "boxoffice-api";

fn rsa_key() -> EncodingKey {
    EncodingKey::from_rsa_pem(include_bytes!("../../testdata/rsa-test-key.pem")).unwrap()
}

fn ec_key() -> EncodingKey {
    EncodingKey::from_ec_pem(include_bytes!("../../testdata/ec-test-key.pem")).unwrap()
}

fn ed_signing(seed: u8) -> ed25519_dalek::SigningKey {
    ed25519_dalek::SigningKey::from_bytes(&[seed; 32])
}

fn ed_key(seed: u8) -> EncodingKey {
    EncodingKey::from_ed_der(ed_signing(seed).to_pkcs8_der().unwrap().as_bytes())
}

/// The public JWK of the Ed25519 key of `seed`.
fn ed_jwk(kid: &str, seed: u8) -> Value {
    let x = URL_SAFE_NO_PAD.encode(ed_signing(seed).verifying_key().as_bytes());
    json!({"kty": "OKP", "crv": "Ed25519", "x": x, "kid": kid, "use": "sig", "alg": "EdDSA"})
}

/// The fixture's RSA and EC keys plus the Ed25519 key of seed 1 under `test-ed-1`.
fn jwks_doc() -> Value {
    let mut doc: Value = serde_json::from_str(include_str!("../../testdata/jwks.json")).unwrap();
    doc["keys"].as_array_mut().unwrap().push(ed_jwk("test-ed-1", 1));
    doc
}

fn policy() -> UserTokenPolicy {
    UserTokenPolicy {
        issuer: Some(ISS.into()),
        audience: Some(AUD.into()),
        max_lifetime_s: 3_600,
        leeway_s: 5,
    }
}

fn claims(sub: &str, iat_offset: i64, ttl_s: i64) -> Value {
    let now = Utc::now().timestamp();
    json!({"sub": sub, "iss": ISS, "aud": AUD, "iat": now + iat_offset, "exp": now + iat_offset + ttl_s})
}

fn sign(alg: Algorithm, kid: Option<&str>, claims: &Value, key: &EncodingKey) -> String {
    let mut h = Header::new(alg);
    h.kid = kid.map(str::to_owned);
    encode(&h, claims, key).unwrap()
}

fn temp_file(name: &str, body: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("boxoffice-jwks-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, body).unwrap();
    path
}

async fn file_verifier(hs256: Option<&[u8]>) -> UserTokens {
    let path = temp_file("jwks.json", &jwks_doc().to_string());
    let jwks = Jwks::load(JwksSettings::new(JwksSource::File(path))).await.unwrap();
    assert_eq!(jwks.kids(), ["test-ec-1", "test-ed-1", "test-rsa-1"]);
    UserTokens::with(policy(), hs256, Some(jwks))
}

#[tokio::test]
async fn tokens_signed_by_jwks_keys_are_accepted() {
    let users = file_verifier(None).await;
    let u = Uuid::new_v4();
    let sub = u.to_string();
    for (alg, kid, key) in [
        (Algorithm::RS256, "test-rsa-1", rsa_key()),
        (Algorithm::ES256, "test-ec-1", ec_key()),
        (Algorithm::EdDSA, "test-ed-1", ed_key(1)),
    ] {
        let t = sign(alg, Some(kid), &claims(&sub, 0, 600), &key);
        assert_eq!(users.authenticate(&t).await, Ok(UserId(u)), "{alg:?}");
        assert_eq!(users.verify(&t), Ok(UserId(u)), "{alg:?} from the cache");
    }
    // An opaque subject maps to one stable id per (issuer, subject).
    let t = sign(Algorithm::RS256, Some("test-rsa-1"), &claims("auth0|abc123", 0, 600), &rsa_key());
    let id = users.verify(&t).unwrap();
    assert_eq!(id, user_id(Some(ISS), "auth0|abc123"));
    assert_ne!(id, user_id(Some("https://other.test/"), "auth0|abc123"));
    // `aud` may be a list that contains ours.
    let mut multi = claims(&sub, 0, 600);
    multi["aud"] = json!(["other", AUD]);
    assert_eq!(users.verify(&sign(Algorithm::EdDSA, Some("test-ed-1"), &multi, &ed_key(1))), Ok(UserId(u)));
    // Within the leeway.
    let t = sign(Algorithm::EdDSA, Some("test-ed-1"), &claims(&sub, -602, 600), &ed_key(1));
    assert_eq!(users.verify(&t), Ok(UserId(u)), "expired 2 s ago, leeway 5 s");
}

#[tokio::test]
async fn every_bad_token_is_refused_with_its_reason() {
    let users = file_verifier(None).await;
    let sub = Uuid::new_v4().to_string();
    let ed = |c: &Value| sign(Algorithm::EdDSA, Some("test-ed-1"), c, &ed_key(1));
    let with = |k: &str, v: Value| {
        let mut c = claims(&sub, 0, 600);
        c[k] = v;
        c
    };
    let without = |k: &str| {
        let mut c = claims(&sub, 0, 600);
        c.as_object_mut().unwrap().remove(k);
        c
    };
    let hs = |secret: &[u8]| {
        sign(Algorithm::HS256, None, &claims(&sub, 0, 600), &EncodingKey::from_secret(secret))
    };
    // The RSA public key's JWK used as an HMAC secret: the classic algorithm confusion.
    let confusion = hs(include_bytes!("../../testdata/jwks.json"));
    let mut tampered = ed(&claims(&sub, 0, 600)).into_bytes();
    let i = tampered.len() - 10;
    tampered[i] = if tampered[i] == b'A' { b'B' } else { b'A' };
    let cases: Vec<(&str, String, UserTokenError)> = vec![
        ("wrong iss", ed(&with("iss", json!("https://evil.test/"))), UserTokenError::WrongIssuer),
        ("no iss", ed(&without("iss")), UserTokenError::Invalid),
        ("wrong aud", ed(&with("aud", json!("another-api"))), UserTokenError::WrongAudience),
        ("no aud", ed(&without("aud")), UserTokenError::Invalid),
        ("expired", ed(&claims(&sub, -700, 600)), UserTokenError::Expired),
        ("too long-lived", ed(&claims(&sub, 0, 3_601)), UserTokenError::LifetimeTooLong { max_s: 3_600 }),
        ("no iat", ed(&without("iat")), UserTokenError::LifetimeTooLong { max_s: 3_600 }),
        ("iat in the future", ed(&claims(&sub, 60, 600)), UserTokenError::NotYetValid),
        (
            "nbf in the future",
            ed(&with("nbf", json!(Utc::now().timestamp() + 60))),
            UserTokenError::NotYetValid,
        ),
        ("no sub", ed(&without("sub")), UserTokenError::Invalid),
        ("empty sub", ed(&with("sub", json!(""))), UserTokenError::Invalid),
        ("blank sub", ed(&with("sub", json!("   "))), UserTokenError::Invalid),
        ("nil sub", ed(&with("sub", json!(Uuid::nil().to_string()))), UserTokenError::Invalid),
        (
            "unknown kid",
            sign(Algorithm::EdDSA, Some("test-ed-9"), &claims(&sub, 0, 600), &ed_key(9)),
            UserTokenError::UnknownKey,
        ),
        (
            "no kid",
            sign(Algorithm::EdDSA, None, &claims(&sub, 0, 600), &ed_key(1)),
            UserTokenError::UnknownKey,
        ),
        (
            "another key under a known kid",
            sign(Algorithm::EdDSA, Some("test-ed-1"), &claims(&sub, 0, 600), &ed_key(2)),
            UserTokenError::Invalid,
        ),
        (
            "algorithm of another key",
            sign(Algorithm::ES256, Some("test-rsa-1"), &claims(&sub, 0, 600), &ec_key()),
            UserTokenError::Invalid,
        ),
        (
            "HS256 in production",
            hs(b"dev-user-secret-change-me-0123456789"),
            UserTokenError::AlgorithmNotAllowed(Algorithm::HS256),
        ),
        ("HS256 with the public key", confusion, UserTokenError::AlgorithmNotAllowed(Algorithm::HS256)),
        (
            "RS384",
            sign(Algorithm::RS384, Some("test-rsa-1"), &claims(&sub, 0, 600), &rsa_key()),
            UserTokenError::AlgorithmNotAllowed(Algorithm::RS384),
        ),
        ("tampered", String::from_utf8(tampered).unwrap(), UserTokenError::Invalid),
        ("not a JWT", "not-a-token".into(), UserTokenError::Malformed),
    ];
    for (what, token, want) in cases {
        assert_eq!(users.authenticate(&token).await, Err(want), "{what}");
    }
}

#[test]
fn development_hs256_tokens_round_trip() {
    let users = UserTokens::new(b"user-secret-user-secret-user-sec");
    assert!(users.accepts_hs256());
    let u = UserId::new();
    let t = users.issue(u, 60);
    assert_eq!(users.verify(&t), Ok(u));
    // No audience configured: a token meant for another audience is not for us.
    let now = Utc::now().timestamp();
    let elsewhere = sign(
        Algorithm::HS256,
        None,
        &json!({"sub": u.0.to_string(), "aud": "another-api", "iat": now, "exp": now + 60}),
        &EncodingKey::from_secret(b"user-secret-user-secret-user-sec"),
    );
    assert_eq!(users.verify(&elsewhere), Err(UserTokenError::WrongAudience));
    let mut bad = t.clone();
    bad.pop();
    bad.push(if t.ends_with('A') { 'B' } else { 'A' });
    assert_eq!(users.verify(&bad), Err(UserTokenError::Invalid));
    assert_eq!(users.verify(&users.issue(u, -120)), Err(UserTokenError::Expired));
    assert_eq!(users.verify(&users.issue(u, 7_201)), Err(UserTokenError::LifetimeTooLong { max_s: 7_200 }));
    // With a policy, minted tokens carry its iss and aud.
    let strict = UserTokens::with(policy(), Some(b"user-secret-user-secret-user-sec"), None);
    assert_eq!(strict.verify(&strict.issue(u, 60)), Ok(u));
    assert_eq!(strict.verify(&t), Err(UserTokenError::Invalid), "no iss/aud");
    // Without JWKS keys, provider algorithms are not accepted at all.
    let rs = sign(Algorithm::RS256, Some("test-rsa-1"), &claims(&u.0.to_string(), 0, 60), &rsa_key());
    assert_eq!(strict.verify(&rs), Err(UserTokenError::AlgorithmNotAllowed(Algorithm::RS256)));
}

#[test]
fn unusable_jwks_entries_are_skipped() {
    let doc = json!({"keys": [
        {"kty": "oct", "kid": "hmac", "k": "c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0"},
        {"kty": "OKP", "crv": "Ed25519", "x": ed_jwk("x", 1)["x"], "kid": "enc", "use": "enc"},
        {"kty": "OKP", "crv": "Ed25519", "x": ed_jwk("x", 1)["x"]},
        {"kty": "EC", "crv": "P-384", "kid": "p384", "x": "AA", "y": "AA"},
        {"kty": "OKP", "crv": "Ed25519", "x": ed_jwk("x", 1)["x"], "kid": "ps", "alg": "PS256"},
        {"kty": "future-kty", "kid": "new"},
        ed_jwk("good", 1),
    ]});
    let keys = parse_key_set(doc.to_string().as_bytes()).unwrap();
    assert_eq!(keys.keys().collect::<Vec<_>>(), ["good"]);
    let none = json!({"keys": [{"kty": "oct", "kid": "hmac", "k": "c2VjcmV0"}]});
    assert!(matches!(
        parse_key_set(none.to_string().as_bytes()),
        Err(JwksError::NoUsableKeys { skipped: 1 })
    ));
    assert!(matches!(parse_key_set(b"[]"), Err(JwksError::Parse(_))));
}

/// A tiny identity provider on 127.0.0.1: serves `doc` (or `status` when not 200) at
/// `/jwks.json` and counts the requests.
#[derive(Clone, Default)]
struct Provider {
    doc: Arc<Mutex<(u16, Value)>>,
    hits: Arc<AtomicUsize>,
}

impl Provider {
    async fn start(doc: Value) -> (Provider, String) {
        use axum::extract::State;
        use axum::http::StatusCode;
        let p = Provider { doc: Arc::new(Mutex::new((200, doc))), hits: Arc::default() };
        let app = axum::Router::new()
            .route(
                "/jwks.json",
                axum::routing::get(|State(p): State<Provider>| async move {
                    p.hits.fetch_add(1, Ordering::SeqCst);
                    let (status, doc) = p.doc.lock().unwrap().clone();
                    (StatusCode::from_u16(status).unwrap(), axum::Json(doc))
                }),
            )
            .with_state(p.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/jwks.json", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (p, url)
    }

    fn publish(&self, status: u16, doc: Value) {
        *self.doc.lock().unwrap() = (status, doc);
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

#[tokio::test]
async fn unknown_kid_rereads_the_url_at_most_once_per_interval() {
    let (idp, url) = Provider::start(json!({"keys": [ed_jwk("k1", 1)]})).await;
    let settings = JwksSettings {
        min_refresh_interval: Duration::from_millis(300),
        ..JwksSettings::new(JwksSource::Url(url))
    };
    let users = UserTokens::with(policy(), None, Some(Jwks::load(settings).await.unwrap()));
    assert_eq!(idp.hits(), 1);
    let sub = Uuid::new_v4().to_string();
    let k1 = sign(Algorithm::EdDSA, Some("k1"), &claims(&sub, 0, 600), &ed_key(1));
    let k2 = sign(Algorithm::EdDSA, Some("k2"), &claims(&sub, 0, 600), &ed_key(2));
    assert!(users.authenticate(&k1).await.is_ok());

    // The provider rotates in k2. Right after a read, an unknown kid waits for the interval.
    idp.publish(200, json!({"keys": [ed_jwk("k1", 1), ed_jwk("k2", 2)]}));
    assert_eq!(users.authenticate(&k2).await, Err(UserTokenError::UnknownKey));
    assert_eq!(idp.hits(), 1, "rate-limited");
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert!(users.authenticate(&k2).await.is_ok(), "re-read on the unknown kid");
    assert_eq!(idp.hits(), 2);

    // A flood of forged kids costs at most one read per interval.
    tokio::time::sleep(Duration::from_millis(350)).await;
    let forged: Vec<String> = (0..50)
        .map(|i| sign(Algorithm::EdDSA, Some(&format!("forged-{i}")), &claims(&sub, 0, 600), &ed_key(3)))
        .collect();
    let results = futures::future::join_all(forged.iter().map(|t| users.authenticate(t))).await;
    assert!(results.iter().all(|r| *r == Err(UserTokenError::UnknownKey)));
    assert_eq!(idp.hits(), 3, "one read for fifty unknown kids");

    // A failed read keeps the cached keys; a key the provider drops stops verifying.
    idp.publish(500, json!({}));
    assert!(users.inner.jwks.as_ref().unwrap().refresh().await.is_err());
    assert!(users.verify(&k1).is_ok(), "kept after a failed read");
    idp.publish(200, json!({"keys": [ed_jwk("k2", 2)]}));
    users.inner.jwks.as_ref().unwrap().refresh().await.unwrap();
    assert_eq!(users.verify(&k1), Err(UserTokenError::UnknownKey), "k1 retired at the provider");
    assert!(users.verify(&k2).is_ok());
}

#[tokio::test]
async fn a_stale_key_set_is_reread_in_the_background() {
    let (idp, url) = Provider::start(json!({"keys": [ed_jwk("k1", 1)]})).await;
    let settings = JwksSettings {
        refresh_after: Duration::from_millis(100),
        min_refresh_interval: Duration::from_millis(50),
        ..JwksSettings::new(JwksSource::Url(url))
    };
    let users = UserTokens::with(policy(), None, Some(Jwks::load(settings).await.unwrap()));
    let k1 = sign(Algorithm::EdDSA, Some("k1"), &claims(&Uuid::new_v4().to_string(), 0, 600), &ed_key(1));
    assert!(users.verify(&k1).is_ok());
    assert_eq!(idp.hits(), 1, "fresh: served from the cache");
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(users.verify(&k1).is_ok(), "served from the cache while re-reading");
    let deadline = Instant::now() + Duration::from_secs(5);
    while idp.hits() < 2 {
        assert!(Instant::now() < deadline, "no background re-read");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_provider_without_usable_keys_fails_the_load() {
    let (_idp, url) = Provider::start(json!({"keys": []})).await;
    let err = Jwks::load(JwksSettings::new(JwksSource::Url(url))).await.unwrap_err();
    assert!(matches!(err, JwksError::NoUsableKeys { skipped: 0 }), "{err}");
    let missing = Jwks::load(JwksSettings::new(JwksSource::File("/nonexistent/jwks.json".into()))).await;
    assert!(matches!(missing, Err(JwksError::Read { .. })));
}
