-- Capture claims the ledger has yet to settle: a `payment_intent.succeeded` webhook for an
-- order whose capture the saga asked for and whose answer the payment worker had not yet
-- recorded (order `confirming`, payment `requires_capture`; `webhooks::judge`'s
-- `capture_outstanding`). Usually the capture's own webhook, a few milliseconds ahead of that
-- record. Instead of a re-fetch command per such webhook (about one ticketed order in two
-- under load, each one a fact to publish, consume and apply that nearly always finds the
-- capture recorded), the claim waits here: the expiry worker's sweep
-- (`stripe_events::settle_capture_claims`, every 10 s) deletes the claims older than
-- `CAPTURE_CLAIM_GRACE_S`, and asks for the re-fetch of those whose capture the ledger still
-- does not record (the capture command was dead-lettered, say). The audit counts claims left
-- unsettled past its grace.
--
-- A queue, not history: a row lives about half a minute. The key orders it by arrival, which
-- is what the sweep reads by, so it is the table's only index.
CREATE TABLE capture_claims (
    received_at       timestamptz NOT NULL DEFAULT now(),
    stripe_event_id   text NOT NULL,
    order_id          uuid NOT NULL,
    payment_intent_id text NOT NULL,
    PRIMARY KEY (received_at, stripe_event_id)
);

CREATE TRIGGER capture_claims_region_fence BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON capture_claims
    FOR EACH STATEMENT EXECUTE FUNCTION region_fence_check();
