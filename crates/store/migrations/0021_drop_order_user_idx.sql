-- no-transaction
-- An index no query reads, dropped (design §12): order_user_idx (orders.user_id,
-- created_at). No statement looks orders up by buyer alone; a buyer's orders of one event (the
-- hold's limits) use order_buyer_idx (event_id, user_id). It cost one entry per order and one
-- per status change (status is order_open_idx's column, so those updates are never HOT):
-- about five per ticketed order.
--
-- Dropped CONCURRENTLY, outside a transaction (one statement in this file, as CONCURRENTLY
-- requires): purchases go on while it waits for the transactions using the table.
DROP INDEX CONCURRENTLY IF EXISTS order_user_idx;
