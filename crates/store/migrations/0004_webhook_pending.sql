-- A Stripe event for a PaymentIntent the ledger does not know yet (its payment row is not
-- committed, and the event names no order) is kept as pending, not dropped: when the
-- payment row is written, the payment worker re-derives the fact from Stripe and resolves
-- the pending rows of that PaymentIntent.
ALTER TABLE stripe_events ADD COLUMN pending boolean NOT NULL DEFAULT false;
ALTER TABLE stripe_events ADD COLUMN resolved_at timestamptz;
CREATE INDEX stripe_events_pending_idx ON stripe_events (payment_intent_id) WHERE pending;
