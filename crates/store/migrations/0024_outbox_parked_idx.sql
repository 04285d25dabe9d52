-- no-transaction
-- The parked outbox rows (migration 0023) in the order they become due, found without
-- reading the outbox: every relay batch and the backlog gauge look for them, and there are
-- none in the ordinary case.
--
-- Built CONCURRENTLY, outside a transaction (one statement in this file, as CONCURRENTLY
-- requires): holds and consumers go on writing outbox rows while it is built. A build that
-- fails leaves an invalid index behind; `boxoffice migrate` drops it before it runs this
-- again (`boxoffice_store::migrate`), so IF NOT EXISTS finds only a valid one: one built by
-- a run that ended before it recorded this migration.
CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_parked_idx ON outbox (retry_at)
    WHERE refused_at IS NOT NULL AND published_at IS NULL;
