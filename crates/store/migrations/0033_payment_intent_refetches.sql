-- The re-fetches webhook claims have asked for and the payment worker has yet to make, one row
-- per PaymentIntent. Each webhook that claims news about a PaymentIntent (a status or amount
-- the ledger does not record) used to commit its own re-fetch command, so whoever holds the
-- signing secret could turn each forged event id into a provider call and a worker
-- transaction. Now a claim that finds a re-fetch of its PaymentIntent asked for less than
-- `stripe_events::REFETCH_COALESCE_S` ago and not made yet only counts itself here
-- (`claims`, `last_claim_at`): the pending re-fetch covers it, since the provider is asked
-- after the claim arrived. The payment worker, in the transaction that records what the
-- provider said, deletes the row if no claim arrived after it read the ledger before its call;
-- otherwise it asks for one more re-fetch (`stripe_events::finish_refetch`). A claim that
-- finds an older row asks again itself. The expiry worker deletes rows left by re-fetches
-- that never ended (dead-lettered) once their last claim is an hour old.
--
-- A queue, not history: a row lives from a claim to the re-fetch's record, usually under a
-- second. `last_claim_at` orders the prune.
CREATE TABLE payment_intent_refetches (
    payment_intent_id text PRIMARY KEY,
    order_id          uuid NOT NULL,
    asked_at          timestamptz NOT NULL,
    last_claim_at     timestamptz NOT NULL,
    claims            integer NOT NULL DEFAULT 1
);

CREATE INDEX payment_intent_refetches_claimed_idx ON payment_intent_refetches (last_claim_at);

CREATE TRIGGER payment_intent_refetches_region_fence
    BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON payment_intent_refetches
    FOR EACH STATEMENT EXECUTE FUNCTION region_fence_check();
