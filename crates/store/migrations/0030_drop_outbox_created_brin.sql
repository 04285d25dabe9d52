-- no-transaction
-- An index no query reads, dropped (design §12): outbox_created_brin. Its prune reads
-- outbox_published_idx (migration 0027); a build that runs beside this one during a rolling
-- upgrade compares with `clock_timestamp()` and reads neither.
--
-- Dropped CONCURRENTLY, outside a transaction (one statement in this file, as CONCURRENTLY
-- requires): the outbox goes on being written while it waits for the transactions using the
-- table.
DROP INDEX CONCURRENTLY IF EXISTS outbox_created_brin;
