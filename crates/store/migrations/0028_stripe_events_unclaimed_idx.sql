-- no-transaction
-- The webhook events recorded without an order id, by arrival, for the expiry worker's prune
-- of those past `webhook_event_retention_s` (`boxoffice_store::stripe_events::prune_unclaimed`,
-- every 10 s): events of PaymentIntents boxoffice did not create (another integration on the
-- same Stripe account) and of types it does not handle, that neither name an order in their
-- metadata nor have a payment row. Events with an order id are not in it: they stay with the
-- order's timeline. There are few of them in the ordinary case.
--
-- Built CONCURRENTLY, outside a transaction (one statement in this file, as CONCURRENTLY
-- requires): webhooks go on being recorded while it is built. A build that fails leaves an
-- invalid index behind; `boxoffice migrate` drops it before it runs this again.
CREATE INDEX CONCURRENTLY IF NOT EXISTS stripe_events_unclaimed_idx ON stripe_events (received_at)
    WHERE order_id IS NULL;
