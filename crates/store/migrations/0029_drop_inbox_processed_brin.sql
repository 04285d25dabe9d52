-- no-transaction
-- An index no query reads, dropped (design §12): inbox_processed_brin. Its prune reads
-- inbox_processed_idx (migration 0026); a build that runs beside this one during a rolling
-- upgrade compares with `clock_timestamp()` and reads neither.
--
-- Dropped CONCURRENTLY, outside a transaction (one statement in this file, as CONCURRENTLY
-- requires): consumers go on recording inbox rows while it waits for the transactions using
-- the table.
DROP INDEX CONCURRENTLY IF EXISTS inbox_processed_brin;
