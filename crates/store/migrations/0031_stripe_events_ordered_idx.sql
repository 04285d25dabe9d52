-- no-transaction
-- The webhook events recorded with an order id, by arrival, for the relay's prune of those
-- past `order_history_retention_days` with the rest of the order's history
-- (`boxoffice_store::timeline::prune`, every 30 s): two or more per ticketed order (its
-- authorization's and its capture's), which would otherwise be kept for ever. Those without
-- an order id have their own index and prune (migration 0028).
--
-- Built CONCURRENTLY, outside a transaction (one statement in this file, as CONCURRENTLY
-- requires): webhooks go on being recorded while it is built. A build that fails leaves an
-- invalid index behind; `boxoffice migrate` drops it before it runs this again.
CREATE INDEX CONCURRENTLY IF NOT EXISTS stripe_events_ordered_idx ON stripe_events (received_at)
    WHERE order_id IS NOT NULL;
