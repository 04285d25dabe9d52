-- no-transaction
-- The recent pending webhook events in arrival order, for the expiry worker's sweep of events
-- that missed their payment row's resolve (`stripe_events::resolve_stranded`, every 10 s).
-- Without it the sweep joins every pending row ever kept to `payments`: rows about
-- PaymentIntents boxoffice did not create (another integration on the same Stripe account)
-- are never resolved, and that join grew with them. Only pending rows are in it, and there
-- are few in the ordinary case.
--
-- Built CONCURRENTLY, outside a transaction (one statement in this file, as CONCURRENTLY
-- requires), as migration 0024: webhooks go on being recorded while it is built; an invalid
-- index a failed build left is dropped by `boxoffice migrate` before it runs this again.
CREATE INDEX CONCURRENTLY IF NOT EXISTS stripe_events_pending_received_idx ON stripe_events (received_at)
    WHERE pending;
