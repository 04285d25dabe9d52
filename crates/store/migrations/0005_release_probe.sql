-- The release controller's commit-latency probe (design §3): one row per purchase cell,
-- upserted by the controller every tick. Timing that tiny write transaction, commit
-- included, measures the commit latency the purchase path sees right now.
CREATE TABLE release_probe (
    cell    text PRIMARY KEY,
    beats   bigint NOT NULL DEFAULT 0,
    beat_at timestamptz NOT NULL
);
