//! Signed tokens at the edge of the purchase path (design §3).
//!
//! - [`UserTokens`]: the buyer's bearer JWT (`sub` = user id). In production it comes from
//!   the identity provider; boxoffice only verifies it (a dev signing key by config).
//! - [`AdmissionTokens`]: proof that the waiting room admitted this buyer for this event and
//!   purchase cell until `exp`. Bound to user, event, cell and expiry; carries a `jti` for
//!   revocation and a `kid` so verification keys can rotate. It is *not* consumed on use: an
//!   HTTP retry with the same token and Idempotency-Key must recover the original order
//!   (invariant 3). It proves admission, never that seats remain.
//!
//! Every rejection names its reason ([`AdmissionError`]) so the API can answer a clear 403.

use boxoffice_domain::{EventId, UserId};
use chrono::Utc;
use jsonwebtoken::{
    decode, decode_header, encode, errors::ErrorKind, Algorithm, DecodingKey, EncodingKey, Header, Validation,
};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use uuid::Uuid;

/// Claims of a user bearer token.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UserClaims {
    /// The user id.
    pub sub: Uuid,
    /// Issued at, unix seconds.
    pub iat: i64,
    /// Expiry, unix seconds.
    pub exp: i64,
}

/// Why a user token was refused (→ 401).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UserTokenError {
    /// Past `exp`.
    #[error("the bearer token has expired")]
    Expired,
    /// Not a JWT signed by our key.
    #[error("the bearer token is invalid")]
    Invalid,
}

/// Issues and verifies user bearer tokens (HS256).
#[derive(Clone)]
pub struct UserTokens {
    enc: EncodingKey,
    dec: DecodingKey,
}

impl UserTokens {
    /// Keys from a shared secret (at least 32 bytes recommended).
    pub fn new(secret: &[u8]) -> Self {
        Self { enc: EncodingKey::from_secret(secret), dec: DecodingKey::from_secret(secret) }
    }

    /// A token for `user` valid for `ttl_s` seconds.
    pub fn issue(&self, user: UserId, ttl_s: i64) -> String {
        let now = Utc::now().timestamp();
        encode(
            &Header::new(Algorithm::HS256),
            &UserClaims { sub: user.0, iat: now, exp: now + ttl_s },
            &self.enc,
        )
        .expect("HS256 signing cannot fail")
    }

    /// The user of a valid token.
    pub fn verify(&self, token: &str) -> Result<UserId, UserTokenError> {
        let mut v = Validation::new(Algorithm::HS256);
        v.leeway = 0;
        decode::<UserClaims>(token, &self.dec, &v).map(|d| UserId(d.claims.sub)).map_err(|e| match e.kind() {
            ErrorKind::ExpiredSignature => UserTokenError::Expired,
            _ => UserTokenError::Invalid,
        })
    }
}

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
    /// Issued at, unix seconds.
    pub iat: i64,
    /// End of the admission slot, unix seconds.
    pub exp: i64,
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
    /// Signed by an unknown key or tampered with.
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
            Self::BadSignature => "admission_token_bad_signature",
            Self::Expired => "admission_token_expired",
            Self::WrongUser => "admission_token_wrong_user",
            Self::WrongEvent => "admission_token_wrong_event",
            Self::WrongCell => "admission_token_wrong_cell",
            Self::Revoked => "admission_token_revoked",
        }
    }
}

/// Signs admission tokens with the current key and verifies them with any active key, so a
/// signing key can rotate while tokens it signed stay valid until their `exp`.
#[derive(Clone)]
pub struct AdmissionTokens {
    signing_kid: String,
    enc: EncodingKey,
    verify: HashMap<String, DecodingKey>,
    cell: String,
}

impl AdmissionTokens {
    /// Keys as `(kid, secret)`; the first signs, all verify. `cell` is this deployment's
    /// purchase cell.
    pub fn new(keys: &[(String, Vec<u8>)], cell: &str) -> Self {
        let (kid, secret) = keys.first().expect("at least one admission key");
        Self {
            signing_kid: kid.clone(),
            enc: EncodingKey::from_secret(secret),
            verify: keys.iter().map(|(k, s)| (k.clone(), DecodingKey::from_secret(s))).collect(),
            cell: cell.to_owned(),
        }
    }

    /// This deployment's purchase cell.
    pub fn cell(&self) -> &str {
        &self.cell
    }

    /// Signs `claims`.
    pub fn sign(&self, claims: &AdmissionClaims) -> String {
        let mut h = Header::new(Algorithm::HS256);
        h.kid = Some(self.signing_kid.clone());
        encode(&h, claims, &self.enc).expect("HS256 signing cannot fail")
    }

    /// Issues a token for `user` at `event` in this cell, valid for `ttl_s` seconds.
    pub fn issue(&self, user: UserId, event: EventId, ttl_s: i64) -> (String, AdmissionClaims) {
        let now = Utc::now().timestamp();
        let claims = AdmissionClaims {
            jti: Uuid::new_v4(),
            sub: user.0,
            event_id: event.0,
            purchase_cell: self.cell.clone(),
            iat: now,
            exp: now + ttl_s,
        };
        (self.sign(&claims), claims)
    }

    /// Verifies signature and expiry, then the binding to `user`, `event` and this cell.
    pub fn verify(
        &self,
        token: &str,
        user: UserId,
        event: EventId,
    ) -> Result<AdmissionClaims, AdmissionError> {
        let header = decode_header(token).map_err(|_| AdmissionError::Malformed)?;
        let key = header.kid.as_ref().and_then(|k| self.verify.get(k)).ok_or(AdmissionError::BadSignature)?;
        let mut v = Validation::new(Algorithm::HS256);
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

    fn keys() -> AdmissionTokens {
        AdmissionTokens::new(
            &[
                ("k2".into(), b"new-secret-new-secret-new-secret".to_vec()),
                ("k1".into(), b"old-secret-old-secret-old-secret".to_vec()),
            ],
            "cell-1",
        )
    }

    #[test]
    fn old_key_still_verifies_after_rotation() {
        let old =
            AdmissionTokens::new(&[("k1".into(), b"old-secret-old-secret-old-secret".to_vec())], "cell-1");
        let (u, e) = (UserId::new(), EventId::new());
        let (t, _) = old.issue(u, e, 60);
        assert!(keys().verify(&t, u, e).is_ok());
        let gone =
            AdmissionTokens::new(&[("k2".into(), b"new-secret-new-secret-new-secret".to_vec())], "cell-1");
        assert_eq!(gone.verify(&t, u, e), Err(AdmissionError::BadSignature));
    }

    #[test]
    fn user_tokens_round_trip_and_reject_tampering() {
        let ut = UserTokens::new(b"user-secret-user-secret-user-sec");
        let u = UserId::new();
        let t = ut.issue(u, 60);
        assert_eq!(ut.verify(&t), Ok(u));
        let mut bad = t.clone();
        bad.pop();
        bad.push(if t.ends_with('A') { 'B' } else { 'A' });
        assert_eq!(ut.verify(&bad), Err(UserTokenError::Invalid));
        assert_eq!(ut.verify(&ut.issue(u, -10)), Err(UserTokenError::Expired));
    }
}
