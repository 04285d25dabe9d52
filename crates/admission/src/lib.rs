//! Signed tokens at the edge of the purchase path (design §3).
//!
//! - [`UserTokens`] (module [`user`]): the buyer's bearer JWT. In production it comes from
//!   the identity provider and is verified with the provider's public keys (a JWKS file or
//!   URL, RS256/ES256/EdDSA by `kid`) against the configured issuer, audience and maximum
//!   lifetime; a shared HS256 secret that can also mint tokens exists for development only.
//! - [`AdmissionTokens`]: proof that the waiting room admitted this buyer for this event and
//!   purchase cell until `exp`. An EdDSA (Ed25519) JWT bound to user, event, cell and expiry;
//!   carries a `jti` for revocation and a `kid` naming the key that signed it. The key ring
//!   holds one signing key and any number of verification keys, so a signing key rotates
//!   without rejecting the tokens it already signed: keep its public half in the ring until
//!   the last of them expires (at most `admission_ttl_s`), then drop it. Verification needs
//!   only public keys, so an API instance can verify without being able to mint.
//!   A token is *not* consumed on use: an HTTP retry with the same token and Idempotency-Key
//!   must recover the original order (invariant 3). It proves admission, never that seats
//!   remain.
//!
//! Every rejection names its reason ([`AdmissionError`]) so the API can answer a clear 403.
//! Keys are never logged: [`AdmissionSigningKey`]'s `Debug` shows only its `kid`.

pub mod user;

pub use user::{
    Jwks, JwksError, JwksSettings, JwksSource, UserClaims, UserTokenError, UserTokenPolicy, UserTokens,
};

use boxoffice_domain::{EventId, UserId};
use chrono::Utc;
use ed25519_dalek::pkcs8::spki::der::pem::LineEnding;
use ed25519_dalek::pkcs8::{DecodePrivateKey, DecodePublicKey, EncodePrivateKey, EncodePublicKey};
use jsonwebtoken::{
    decode, decode_header, encode, errors::ErrorKind, Algorithm, DecodingKey, EncodingKey, Header, Validation,
};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use uuid::Uuid;

/// Claims of an admission token (design §3).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdmissionClaims {
    /// Token id, for revocation.
    pub jti: Uuid,
    /// The admitted user.
    pub sub: Uuid,
    /// The event the buyer was admitted to.
    pub event_id: Uuid,
    /// The purchase cell serving that event.
    pub purchase_cell: String,
    /// The event directory's epoch for the event when the token was minted (design §13): the
    /// hold transaction refuses a token whose epoch is not the event's in the cell's ledger,
    /// so a token minted before a move is refused after it. Tokens without it are epoch 1.
    #[serde(default = "first_epoch")]
    pub directory_epoch: i64,
    /// Issued at, unix seconds.
    pub iat: i64,
    /// End of the admission slot, unix seconds (the token is refused from this second on).
    pub exp: i64,
}

fn first_epoch() -> i64 {
    1
}

/// Why an admission token was refused (→ 403 with this reason).
#[derive(Debug, thiserror::Error, PartialEq, Eq, Clone, Copy)]
pub enum AdmissionError {
    /// No `X-Admission-Token` header.
    #[error("an admission token is required")]
    Missing,
    /// Not a well-formed token.
    #[error("the admission token is malformed")]
    Malformed,
    /// The header names no `kid`, or one that is not in the key ring (never issued here, or
    /// retired after rotation).
    #[error("the admission token was signed by an unknown key")]
    UnknownKid,
    /// Tampered with, signed by another key under a known `kid`, or not `alg = EdDSA`.
    #[error("the admission token signature is invalid")]
    BadSignature,
    /// The admission slot has ended.
    #[error("the admission token has expired")]
    Expired,
    /// Issued for another user.
    #[error("the admission token was issued to another user")]
    WrongUser,
    /// Issued for another event.
    #[error("the admission token is for another event")]
    WrongEvent,
    /// Issued by another purchase cell.
    #[error("the admission token is for another purchase cell")]
    WrongCell,
    /// Revoked by its `jti`.
    #[error("the admission token was revoked")]
    Revoked,
}

impl AdmissionError {
    /// A stable machine-readable reason for problem+json bodies.
    pub fn code(self) -> &'static str {
        match self {
            Self::Missing => "admission_token_missing",
            Self::Malformed => "admission_token_malformed",
            Self::UnknownKid => "admission_token_unknown_kid",
            Self::BadSignature => "admission_token_bad_signature",
            Self::Expired => "admission_token_expired",
            Self::WrongUser => "admission_token_wrong_user",
            Self::WrongEvent => "admission_token_wrong_event",
            Self::WrongCell => "admission_token_wrong_cell",
            Self::Revoked => "admission_token_revoked",
        }
    }
}

/// Why a key could not be loaded or the key ring is inconsistent.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// Not a PKCS#8 Ed25519 private key (`-----BEGIN PRIVATE KEY-----`). The cause is not
    /// carried: it could echo key material.
    #[error("admission key {kid:?}: not a PKCS#8 Ed25519 private key in PEM")]
    BadPrivateKey {
        /// The key's id.
        kid: String,
    },
    /// Not an SPKI Ed25519 public key (`-----BEGIN PUBLIC KEY-----`).
    #[error("admission key {kid:?}: not an Ed25519 public key in PEM (SPKI)")]
    BadPublicKey {
        /// The key's id.
        kid: String,
    },
    /// Empty `kid`.
    #[error("an admission key needs a non-empty kid")]
    EmptyKid,
    /// Two different keys under one `kid`.
    #[error("two different admission keys share the kid {0:?}")]
    KidConflict(String),
}

/// The Ed25519 key that signs admission tokens, with its `kid`. `Debug` shows the `kid` only.
#[derive(Clone)]
pub struct AdmissionSigningKey {
    kid: String,
    key: ed25519_dalek::SigningKey,
}

impl std::fmt::Debug for AdmissionSigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdmissionSigningKey").field("kid", &self.kid).finish_non_exhaustive()
    }
}

/// The `kid` of [`AdmissionSigningKey::dev`].
pub const DEV_KID: &str = "dev-ed25519-1";

impl AdmissionSigningKey {
    /// Parses a PKCS#8 PEM private key (`openssl genpkey -algorithm ed25519`).
    ///
    /// # Errors
    /// [`KeyError::BadPrivateKey`] when `pem` is not an Ed25519 PKCS#8 key, [`KeyError::EmptyKid`].
    pub fn from_pem(kid: &str, pem: &str) -> Result<Self, KeyError> {
        if kid.is_empty() {
            return Err(KeyError::EmptyKid);
        }
        let key = ed25519_dalek::SigningKey::from_pkcs8_pem(pem.trim())
            .map_err(|_| KeyError::BadPrivateKey { kid: kid.to_owned() })?;
        Ok(Self { kid: kid.to_owned(), key })
    }

    /// A key from a 32-byte seed (tests and the dev key).
    pub fn from_seed(kid: &str, seed: [u8; 32]) -> Self {
        Self { kid: kid.to_owned(), key: ed25519_dalek::SigningKey::from_bytes(&seed) }
    }

    /// A fresh random key (operating-system-seeded CSPRNG).
    pub fn generate(kid: &str) -> Self {
        Self::from_seed(kid, rand::random())
    }

    /// The development key, derived from a fixed public seed (`kid` [`DEV_KID`]): anyone can
    /// mint tokens with it, so production configuration must replace it.
    pub fn dev() -> Self {
        Self::from_seed(DEV_KID, *b"boxoffice-dev-admission-key-0001")
    }

    /// The key id placed in every token header.
    pub fn kid(&self) -> &str {
        &self.kid
    }

    /// The private key as PKCS#8 PEM. Secret: never log it.
    pub fn to_pkcs8_pem(&self) -> String {
        self.key.to_pkcs8_pem(LineEnding::LF).expect("an Ed25519 key encodes").to_string()
    }

    /// The public half, for the verification ring of other instances.
    pub fn verifying_key(&self) -> AdmissionVerifyingKey {
        AdmissionVerifyingKey { kid: self.kid.clone(), key: self.key.verifying_key() }
    }
}

/// An Ed25519 public key that verifies admission tokens carrying its `kid`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdmissionVerifyingKey {
    kid: String,
    key: ed25519_dalek::VerifyingKey,
}

impl AdmissionVerifyingKey {
    /// Parses an SPKI PEM public key (`openssl pkey -pubout`).
    ///
    /// # Errors
    /// [`KeyError::BadPublicKey`], [`KeyError::EmptyKid`].
    pub fn from_pem(kid: &str, pem: &str) -> Result<Self, KeyError> {
        if kid.is_empty() {
            return Err(KeyError::EmptyKid);
        }
        let key = ed25519_dalek::VerifyingKey::from_public_key_pem(pem.trim())
            .map_err(|_| KeyError::BadPublicKey { kid: kid.to_owned() })?;
        Ok(Self { kid: kid.to_owned(), key })
    }

    /// The key id.
    pub fn kid(&self) -> &str {
        &self.kid
    }

    /// The public key as SPKI PEM.
    pub fn to_pem(&self) -> String {
        self.key.to_public_key_pem(LineEnding::LF).expect("an Ed25519 key encodes")
    }
}

/// Signs admission tokens with the current key and verifies them with any key of the ring, so
/// a signing key can rotate while tokens it signed stay valid until their `exp`.
#[derive(Clone)]
pub struct AdmissionTokens {
    signing_kid: String,
    enc: EncodingKey,
    verify: HashMap<String, DecodingKey>,
    cell: String,
}

impl AdmissionTokens {
    /// A ring that signs with `signing` and verifies with its public half plus every key of
    /// `verifying` (previous keys still covering live tokens, or the next key being rolled
    /// out). `cell` is this deployment's purchase cell.
    ///
    /// # Errors
    /// [`KeyError::KidConflict`] when two different keys share a `kid`.
    pub fn new(
        signing: &AdmissionSigningKey,
        verifying: &[AdmissionVerifyingKey],
        cell: &str,
    ) -> Result<Self, KeyError> {
        let own = signing.verifying_key();
        let mut ring: HashMap<String, AdmissionVerifyingKey> = HashMap::new();
        for k in std::iter::once(&own).chain(verifying) {
            match ring.get(&k.kid) {
                Some(existing) if existing != k => return Err(KeyError::KidConflict(k.kid.clone())),
                _ => {
                    ring.insert(k.kid.clone(), k.clone());
                }
            }
        }
        let der = signing.key.to_pkcs8_der().expect("an Ed25519 key encodes");
        Ok(Self {
            signing_kid: signing.kid.clone(),
            enc: EncodingKey::from_ed_der(der.as_bytes()),
            verify: ring
                .into_iter()
                .map(|(kid, k)| (kid, DecodingKey::from_ed_der(k.key.as_bytes())))
                .collect(),
            cell: cell.to_owned(),
        })
    }

    /// This deployment's purchase cell.
    pub fn cell(&self) -> &str {
        &self.cell
    }

    /// The `kid` new tokens are signed with.
    pub fn signing_kid(&self) -> &str {
        &self.signing_kid
    }

    /// The `kid`s this ring verifies, sorted.
    pub fn verification_kids(&self) -> Vec<&str> {
        let mut kids: Vec<&str> = self.verify.keys().map(String::as_str).collect();
        kids.sort_unstable();
        kids
    }

    /// Signs `claims` (`alg = EdDSA`, `kid` = the signing key's). Ed25519 is deterministic:
    /// the same claims always give the same token.
    pub fn sign(&self, claims: &AdmissionClaims) -> String {
        let mut h = Header::new(Algorithm::EdDSA);
        h.kid = Some(self.signing_kid.clone());
        encode(&h, claims, &self.enc).expect("Ed25519 signing with a parsed key cannot fail")
    }

    /// Issues a token for `user` at `event` in this cell at the event's `directory_epoch`
    /// (as this cell's ledger has it), valid for `ttl_s` seconds from now, with a fresh `jti`.
    pub fn issue(
        &self,
        user: UserId,
        event: EventId,
        directory_epoch: i64,
        ttl_s: i64,
    ) -> (String, AdmissionClaims) {
        let now = Utc::now().timestamp();
        let claims = AdmissionClaims {
            jti: Uuid::new_v4(),
            sub: user.0,
            event_id: event.0,
            purchase_cell: self.cell.clone(),
            directory_epoch,
            iat: now,
            exp: now + ttl_s,
        };
        (self.sign(&claims), claims)
    }

    /// Verifies `kid`, algorithm, signature and expiry locally (no network), then the binding
    /// to `user`, `event` and this cell. Revocation is the caller's check (it needs the
    /// waiting room's store).
    ///
    /// # Errors
    /// The first failing check, as an [`AdmissionError`].
    pub fn verify(
        &self,
        token: &str,
        user: UserId,
        event: EventId,
    ) -> Result<AdmissionClaims, AdmissionError> {
        let header = decode_header(token).map_err(|_| AdmissionError::Malformed)?;
        let key = header.kid.as_ref().and_then(|k| self.verify.get(k)).ok_or(AdmissionError::UnknownKid)?;
        let mut v = Validation::new(Algorithm::EdDSA);
        v.leeway = 0;
        v.required_spec_claims = ["exp".to_owned()].into_iter().collect();
        let claims = decode::<AdmissionClaims>(token, key, &v)
            .map_err(|e| match e.kind() {
                ErrorKind::ExpiredSignature => AdmissionError::Expired,
                ErrorKind::InvalidSignature | ErrorKind::InvalidAlgorithm => AdmissionError::BadSignature,
                _ => AdmissionError::Malformed,
            })?
            .claims;
        if claims.exp <= Utc::now().timestamp() {
            return Err(AdmissionError::Expired);
        }
        if claims.sub != user.0 {
            return Err(AdmissionError::WrongUser);
        }
        if claims.event_id != event.0 {
            return Err(AdmissionError::WrongEvent);
        }
        if claims.purchase_cell != self.cell {
            return Err(AdmissionError::WrongCell);
        }
        Ok(claims)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims(user: UserId, event: EventId, exp_in: i64) -> AdmissionClaims {
        let now = Utc::now().timestamp();
        AdmissionClaims {
            jti: Uuid::new_v4(),
            sub: user.0,
            event_id: event.0,
            purchase_cell: "cell-1".into(),
            directory_epoch: 1,
            iat: now,
            exp: now + exp_in,
        }
    }

    /// Flips one character in the middle of the signature (the last character may only carry
    /// padding bits).
    fn tamper(token: &str) -> String {
        let mut b = token.as_bytes().to_vec();
        let i = b.len() - 10;
        b[i] = if b[i] == b'A' { b'B' } else { b'A' };
        String::from_utf8(b).unwrap()
    }

    #[test]
    fn rotation_keeps_old_tokens_until_their_key_is_removed() {
        let k1 = AdmissionSigningKey::from_seed("k1", [1; 32]);
        let k2 = AdmissionSigningKey::from_seed("k2", [2; 32]);
        let (u, e) = (UserId::new(), EventId::new());
        let before = AdmissionTokens::new(&k1, &[], "cell-1").unwrap();
        let (old, _) = before.issue(u, e, 1, 60);
        // Rotated: k2 signs, k1 still verifies.
        let rotated = AdmissionTokens::new(&k2, &[k1.verifying_key()], "cell-1").unwrap();
        assert!(rotated.verify(&old, u, e).is_ok());
        let (new, _) = rotated.issue(u, e, 1, 60);
        assert!(rotated.verify(&new, u, e).is_ok());
        assert_eq!(rotated.verification_kids(), ["k1", "k2"]);
        // k1 retired.
        let retired = AdmissionTokens::new(&k2, &[], "cell-1").unwrap();
        assert_eq!(retired.verify(&old, u, e), Err(AdmissionError::UnknownKid));
        assert!(retired.verify(&new, u, e).is_ok());
    }

    #[test]
    fn every_bad_token_has_its_own_reason() {
        let ring =
            AdmissionTokens::new(&AdmissionSigningKey::from_seed("k1", [1; 32]), &[], "cell-1").unwrap();
        let (u, e) = (UserId::new(), EventId::new());
        let good = ring.sign(&claims(u, e, 60));
        let tampered = tamper(&good);
        let impostor = AdmissionTokens::new(&AdmissionSigningKey::from_seed("k1", [9; 32]), &[], "cell-1")
            .unwrap()
            .sign(&claims(u, e, 60));
        let hs256 = {
            let mut h = Header::new(Algorithm::HS256);
            h.kid = Some("k1".into());
            encode(&h, &claims(u, e, 60), &EncodingKey::from_secret(b"k1")).unwrap()
        };
        let no_kid = encode(
            &Header::new(Algorithm::EdDSA),
            &claims(u, e, 60),
            &EncodingKey::from_ed_der(
                AdmissionSigningKey::from_seed("k1", [1; 32]).key.to_pkcs8_der().unwrap().as_bytes(),
            ),
        )
        .unwrap();
        let other_cell = ring.sign(&AdmissionClaims { purchase_cell: "cell-2".into(), ..claims(u, e, 60) });
        let cases = [
            (ring.sign(&claims(u, e, -1)), AdmissionError::Expired),
            (ring.sign(&claims(u, EventId::new(), 60)), AdmissionError::WrongEvent),
            (ring.sign(&claims(UserId::new(), e, 60)), AdmissionError::WrongUser),
            (tampered, AdmissionError::BadSignature),
            (impostor, AdmissionError::BadSignature),
            (hs256, AdmissionError::BadSignature),
            (no_kid, AdmissionError::UnknownKid),
            (other_cell, AdmissionError::WrongCell),
            ("not-a-token".into(), AdmissionError::Malformed),
        ];
        for (i, (t, want)) in cases.iter().enumerate() {
            assert_eq!(ring.verify(t, u, e), Err(*want), "case {i}");
        }
        assert!(ring.verify(&good, u, e).is_ok());
        assert_eq!(ring.verify(&good, u, e).unwrap(), ring.verify(&good, u, e).unwrap(), "not consumed");
    }

    #[test]
    fn keys_round_trip_through_pem_and_conflicts_are_refused() {
        let k = AdmissionSigningKey::dev();
        assert_eq!(k.kid(), DEV_KID);
        let pem = k.to_pkcs8_pem();
        assert!(pem.starts_with("-----BEGIN PRIVATE KEY-----"));
        let back = AdmissionSigningKey::from_pem(DEV_KID, &pem).unwrap();
        assert_eq!(back.verifying_key(), k.verifying_key());
        let public = AdmissionVerifyingKey::from_pem(DEV_KID, &k.verifying_key().to_pem()).unwrap();
        assert_eq!(public, k.verifying_key());
        assert!(!format!("{k:?}").contains("PRIVATE"), "Debug shows the kid only");
        assert!(matches!(AdmissionSigningKey::from_pem("x", "nope"), Err(KeyError::BadPrivateKey { .. })));
        assert!(matches!(AdmissionVerifyingKey::from_pem("x", &pem), Err(KeyError::BadPublicKey { .. })));
        let other = AdmissionSigningKey::from_seed(DEV_KID, [7; 32]).verifying_key();
        assert!(matches!(AdmissionTokens::new(&k, &[other], "c"), Err(KeyError::KidConflict(_))));
        assert!(
            AdmissionTokens::new(&k, &[k.verifying_key()], "c").is_ok(),
            "listing the signer's own key is fine"
        );
        assert_ne!(
            AdmissionSigningKey::generate("g").verifying_key(),
            AdmissionSigningKey::generate("g").verifying_key()
        );
    }
}
