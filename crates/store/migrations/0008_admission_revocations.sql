-- Revoked admission tokens: the durable record behind the waiting room's revocation set in
-- Redis, so a Redis that restarts (and forgets its keys) does not bring a revoked token back.
-- One row per token id (`jti`); a token never outlives its `exp`, so neither does its row's
-- meaning: rows past `revoked_until` are pruned.
CREATE TABLE admission_revocations (
    jti           uuid        PRIMARY KEY,
    revoked_until timestamptz NOT NULL,
    revoked_at    timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX admission_revocations_until_idx ON admission_revocations (revoked_until);
