-- A budget for the re-fetches of an order's own PaymentIntent. Claims about it share one
-- pending re-fetch (migrations 0033, 0034), but that bounded only the claims that arrive while
-- one is pending: whoever holds the signing secret could send a claim each time a re-fetch
-- ended (each asked a new one), or a steady stream (each re-fetch found a claim newer than its
-- read and asked once more), and so keep one provider call after another going for every order
-- that has a payment row, enough to delay every buyer's payment.
--
-- A pending re-fetch's row now outlives the re-fetch: the payment worker marks it made
-- (`asked_at` = '-infinity', which a claim of any build reads as a re-fetch asked long ago,
-- so the next claim asks again) instead of deleting it, and the row counts the re-fetches
-- claims asked for in the window that began with the first of them (`asks`,
-- `window_started_at`; `stripe_events::REFETCHES_PER_PAYMENT_INTENT` in
-- `stripe_events::REFETCH_BUDGET_WINDOW_S`). A claim that would ask one more is recorded and
-- left to the hold's provider check and to reconciliation. The payment worker's own
-- follow-ups (a claim counted while its call was under way) are counted apart, in a table
-- only the payment worker writes (`payment_intent_follow_ups`), so it never waits for a
-- claim's lock to count one. The expiry worker's prune of this table (an hour after the last
-- claim) now also ends a window.
ALTER TABLE payment_intent_refetches
    ADD COLUMN window_started_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN asks integer NOT NULL DEFAULT 1;

CREATE TABLE payment_intent_follow_ups (
    payment_intent_id text NOT NULL,
    order_id          uuid NOT NULL,
    window_started_at timestamptz NOT NULL,
    made              integer NOT NULL,
    PRIMARY KEY (payment_intent_id, order_id)
);

CREATE INDEX payment_intent_follow_ups_window_idx ON payment_intent_follow_ups (window_started_at);

CREATE TRIGGER payment_intent_follow_ups_region_fence
    BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON payment_intent_follow_ups
    FOR EACH STATEMENT EXECUTE FUNCTION region_fence_check();
