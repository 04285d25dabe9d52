//! Case C17 and buyer tokens as identity providers issue them: the compiled `boxoffice serve`
//! refuses production with the built-in development secrets (exit 2, every offending setting
//! named, no secret printed) and starts in development with one warning per built-in secret;
//! through the HTTP API, a production deployment accepts tokens signed by the identity
//! provider's JWKS keys and answers 401 problem+json, with the reason, to a wrong issuer or
//! audience, an expired or too long-lived token, an unknown `kid` and an HS256 token.

use crate::helpers::{problem, product_bin, TestApp};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use boxoffice::config::{Environment, DEV_STRIPE_SECRET_KEY, DEV_USER_JWT_SECRET, DEV_WEBHOOK_SECRETS};
use boxoffice::runtime::{self, Role};
use boxoffice_store::venue::VenueSpec;
use ed25519_dalek::pkcs8::EncodePrivateKey;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{json, Value};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncBufReadExt;
use uuid::Uuid;

const ISS: &str = "https://id.example.test/";
const AUD: &str = "boxoffice-api";

/// The product binary with no `BOXOFFICE_*` variable of the test's environment.
fn product(args: &[&str]) -> Command {
    let mut cmd = Command::new(product_bin());
    cmd.args(args);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("BOXOFFICE_")) {
        cmd.env_remove(k);
    }
    cmd
}

fn builtin_secrets() -> Vec<String> {
    vec![
        DEV_USER_JWT_SECRET.into(),
        DEV_STRIPE_SECRET_KEY.into(),
        DEV_WEBHOOK_SECRETS[0].into(),
        boxoffice::config::DEV_ADMIN_TOKEN.into(),
        "PRIVATE KEY".into(),
        boxoffice_admission::AdmissionSigningKey::dev().to_pkcs8_pem(),
    ]
}

#[test]
fn production_start_with_builtin_secrets_is_refused_naming_each_setting() {
    let out = product(&["serve", "--roles", "expiry"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    let named: Vec<&str> =
        stderr.lines().filter_map(|l| l.strip_prefix("  - ")).filter_map(|l| l.split(':').next()).collect();
    assert_eq!(
        named,
        [
            "user_jwks_url",
            "user_jwt_issuer",
            "user_jwt_audience",
            "admission_private_key",
            "stripe_secret_key",
            "stripe_webhook_secret",
            "admin_token",
            "webhook_allowed_networks"
        ],
        "{stderr}"
    );
    assert!(stderr.contains("refusing to start in production: 8 settings must change"), "{stderr}");
    for secret in builtin_secrets() {
        assert!(!stderr.contains(&secret), "a secret was printed: {stderr}");
    }
    // The same refusal whatever the command: production is the product binary's default.
    let token = product(&["user-token"]).output().unwrap();
    assert_eq!(token.status.code(), Some(2));
    assert!(token.stdout.is_empty(), "no token minted");
}

#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn development_start_warns_once_per_builtin_secret(_: PgPoolOptions, opts: PgConnectOptions) {
    let mut cmd = tokio::process::Command::from(product(&["serve", "--roles", "expiry"]));
    let mut child = cmd
        .env("BOXOFFICE_ENV", "development")
        .env("BOXOFFICE_DATABASE_URL", sqlx::ConnectOptions::to_url_lossy(&opts).to_string())
        .env("BOXOFFICE_LOG_FORMAT", "json")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let mut seen = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            let started = line.contains("roles started");
            seen.push(line);
            if started {
                return;
            }
        }
        panic!("serve exited before starting:\n{}", seen.join("\n"));
    })
    .await;
    child.kill().await.unwrap();
    assert!(read.is_ok(), "serve did not start in 60 s:\n{}", seen.join("\n"));
    let warned: Vec<String> = seen
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["level"] == "WARN")
        .filter_map(|v| v["fields"]["setting"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(
        warned,
        [
            "user_jwt_secret",
            "admission_private_key",
            "stripe_secret_key",
            "stripe_webhook_secret",
            "admin_token"
        ],
        "{seen:#?}"
    );
    let all = seen.join("\n");
    for secret in builtin_secrets() {
        assert!(!all.contains(&secret), "a secret was logged: {all}");
    }
}

/// An Ed25519 signing key of the identity provider and its public JWK.
fn idp_key(kid: &str, seed: u8) -> (EncodingKey, Value) {
    let key = ed25519_dalek::SigningKey::from_bytes(&[seed; 32]);
    let enc = EncodingKey::from_ed_der(key.to_pkcs8_der().unwrap().as_bytes());
    let x = URL_SAFE_NO_PAD.encode(key.verifying_key().as_bytes());
    (enc, json!({"kty": "OKP", "crv": "Ed25519", "x": x, "kid": kid, "use": "sig", "alg": "EdDSA"}))
}

fn token(key: &EncodingKey, kid: &str, claims: Value) -> String {
    let mut h = Header::new(Algorithm::EdDSA);
    h.kid = Some(kid.into());
    jsonwebtoken::encode(&h, &claims, key).unwrap()
}

fn claims(sub: Uuid, iat_offset_s: i64, ttl_s: i64) -> Value {
    let now = chrono::Utc::now().timestamp();
    json!({"sub": sub, "iss": ISS, "aud": AUD, "iat": now + iat_offset_s, "exp": now + iat_offset_s + ttl_s})
}

/// `GET /orders/{random}` with `bearer`: 404 once authenticated, 401 when refused.
async fn get_order(app: &TestApp, bearer: &str) -> (u16, String, Value) {
    let r = app
        .http
        .get(format!("{}/orders/{}", app.api, Uuid::new_v4()))
        .header("authorization", format!("Bearer {bearer}"))
        .send()
        .await
        .unwrap();
    problem(r).await
}

fn production_tokens(cfg: &mut boxoffice::config::Config) {
    cfg.env = Environment::Production;
    cfg.webhook_allowed_networks = vec!["127.0.0.0/8".into()];
    cfg.user_jwt_issuer = Some(ISS.into());
    cfg.user_jwt_audience = Some(AUD.into());
    cfg.user_jwt_max_lifetime_s = 3_600;
    cfg.user_jwt_leeway_s = 5;
}

#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn production_api_accepts_jwks_tokens_and_refuses_the_rest(_: PgPoolOptions, opts: PgConnectOptions) {
    let (idp, jwk) = idp_key("idp-1", 11);
    let dir = std::env::temp_dir().join(format!("boxoffice-jwks-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let jwks_file = dir.join("jwks.json");
    std::fs::write(&jwks_file, json!({"keys": [jwk]}).to_string()).unwrap();
    let app = TestApp::spawn_with(opts, &[Role::Api], VenueSpec::small(1, 1, 2), |c| {
        production_tokens(c);
        c.user_jwks_file = Some(jwks_file.display().to_string());
    })
    .await;
    let u = Uuid::new_v4();

    let (status, code, body) = get_order(&app, &token(&idp, "idp-1", claims(u, 0, 600))).await;
    assert_eq!((status, code.as_str()), (404, "not_found"), "authenticated: {body}");

    let (other, _) = idp_key("idp-9", 99);
    let mut wrong_iss = claims(u, 0, 600);
    wrong_iss["iss"] = json!("https://evil.test/");
    let mut wrong_aud = claims(u, 0, 600);
    wrong_aud["aud"] = json!("another-api");
    let cases = [
        ("wrong iss", token(&idp, "idp-1", wrong_iss), "another issuer"),
        ("wrong aud", token(&idp, "idp-1", wrong_aud), "another audience"),
        ("expired", token(&idp, "idp-1", claims(u, -700, 600)), "expired"),
        ("too long-lived", token(&idp, "idp-1", claims(u, 0, 3_601)), "longer than 3600 s"),
        ("unknown kid", token(&other, "idp-9", claims(u, 0, 600)), "unknown key"),
        // What the development secret mints (and `boxoffice user-token` would print).
        ("HS256", runtime::user_tokens(&app.cfg).issue(boxoffice_domain::UserId(u), 600), "HS256"),
    ];
    for (what, t, reason) in cases {
        let (status, code, body) = get_order(&app, &t).await;
        assert_eq!((status, code.as_str()), (401, "unauthenticated"), "{what}: {body}");
        assert!(body["detail"].as_str().unwrap_or_default().contains(reason), "{what}: {body}");
    }
    app.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

/// The identity provider's JWKS at a URL on 127.0.0.1: a key it rotates in after the API
/// started is fetched on its first token.
#[sqlx::test(migrator = "boxoffice_store::MIGRATOR")]
async fn a_key_rotated_in_at_the_jwks_url_is_fetched_on_first_use(_: PgPoolOptions, opts: PgConnectOptions) {
    let (k1, jwk1) = idp_key("idp-1", 21);
    let (k2, jwk2) = idp_key("idp-2", 22);
    let doc = Arc::new(Mutex::new(json!({"keys": [jwk1.clone()]})));
    let served = doc.clone();
    let router = axum::Router::new().route(
        "/.well-known/jwks.json",
        axum::routing::get(move || {
            let d = served.lock().unwrap().clone();
            async move { axum::Json(d) }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    // Plain http on loopback for the test; production validation requires https.
    let url = format!("http://{}/.well-known/jwks.json", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let app = TestApp::spawn_with(opts, &[Role::Api], VenueSpec::small(1, 1, 2), |c| {
        production_tokens(c);
        c.user_jwks_url = Some(url);
        c.user_jwks_min_refresh_s = 0;
    })
    .await;
    let u = Uuid::new_v4();
    assert_eq!(get_order(&app, &token(&k1, "idp-1", claims(u, 0, 600))).await.0, 404);
    let rotated = token(&k2, "idp-2", claims(u, 0, 600));
    assert_eq!(get_order(&app, &rotated).await.0, 401, "not published yet");
    *doc.lock().unwrap() = json!({"keys": [jwk1, jwk2]});
    assert_eq!(get_order(&app, &rotated).await.0, 404, "fetched on the unknown kid");
    app.stop().await;
}
