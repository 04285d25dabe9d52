-- A pending re-fetch covers the claims about one PaymentIntent made for one order, not for
-- any order (migration 0033 keyed it by the PaymentIntent alone). A claim names its order in
-- the PaymentIntent's metadata, and an authorization claim naming a PaymentIntent that is not
-- its order's current one is checked too; so whoever holds the signing secret could name
-- another buyer's PaymentIntent under an order of their own, and the genuine claim for the
-- buyer's order would then be covered by a re-fetch made for the wrong order, which refutes
-- it and asks nothing for the buyer's. Keyed by (PaymentIntent, order), each order's claims
-- have their own pending re-fetch, made for that order.
--
-- The table is a queue of a few rows; rebuilding its key is instant.
ALTER TABLE payment_intent_refetches
    DROP CONSTRAINT payment_intent_refetches_pkey,
    ADD PRIMARY KEY (payment_intent_id, order_id);
