-- Each order's budget of re-fetches asked for by webhook claims that no pending re-fetch can
-- cover: an authorization claim naming a PaymentIntent that is not the order's recorded one
-- (or claimed before the order has a payment row), and a dispute claim. Claims about the
-- order's own PaymentIntent share one pending re-fetch (migrations 0033, 0034), but each such
-- claim names an object of its own, so whoever holds the signing secret could name a new
-- PaymentIntent or dispute id in each forged event and turn each into a provider call and a
-- payment worker transaction, enough to delay every buyer's payment. A claim of this kind
-- asks for its re-fetch only while its order has asked fewer than
-- `stripe_events::UNCOVERED_REFETCHES_PER_ORDER` in the window that began with its first one
-- (`stripe_events::UNCOVERED_REFETCH_WINDOW_S`); any later one is recorded and left to
-- reconciliation, which reads the provider's PaymentIntents, not claims.
--
-- One row per order that had such a claim, which normal purchases never have. The expiry
-- worker deletes rows whose window ended; `window_started_at` orders that prune.
CREATE TABLE order_refetch_budget (
    order_id          uuid PRIMARY KEY,
    window_started_at timestamptz NOT NULL,
    asked             integer NOT NULL
);

CREATE INDEX order_refetch_budget_window_idx ON order_refetch_budget (window_started_at);

CREATE TRIGGER order_refetch_budget_region_fence
    BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON order_refetch_budget
    FOR EACH STATEMENT EXECUTE FUNCTION region_fence_check();
