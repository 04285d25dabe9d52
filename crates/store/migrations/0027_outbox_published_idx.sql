-- no-transaction
-- The published outbox rows by creation time, for the relay's move of rows past
-- `outbox_retention_s` into the order history (`boxoffice_store::outbox::prune_published`,
-- every 30 s). The BRIN index of migration 0002 was never read: the prune compared with
-- `clock_timestamp()`, which no index can take, so each pass read the whole outbox (an hour of
-- facts). Only published rows are in this one: a row enters it when the relay marks it, an
-- update that is never HOT anyway (`published_at` is in the predicates of
-- `outbox_pending_idx` and `outbox_parked_idx`). Migration 0030 drops the BRIN index.
--
-- Built CONCURRENTLY, outside a transaction (one statement in this file, as CONCURRENTLY
-- requires): holds, consumers and the relay go on writing the outbox while it is built. A
-- build that fails leaves an invalid index behind; `boxoffice migrate` drops it before it
-- runs this again.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_published_idx ON outbox (created_at)
    WHERE published_at IS NOT NULL;
