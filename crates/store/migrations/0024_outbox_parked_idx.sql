-- no-transaction
-- The parked outbox rows (migration 0023), found without reading the outbox: every relay
-- batch and the backlog gauge look for them, and there are none in the ordinary case.
--
-- Built CONCURRENTLY, outside a transaction (one statement in this file, as CONCURRENTLY
-- requires): holds and consumers go on writing outbox rows while it is built.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_parked_idx ON outbox (refused_at)
    WHERE refused_at IS NOT NULL AND published_at IS NULL;
