-- The business timeline (design §16): who moved an order, and why.
--
-- Every write that matters to an order's story records the transaction that made it
-- (`pg_current_xact_id()`, 64-bit, never reused by the cluster). Rows of one transaction
-- belong to one step: a consumer's inbox row names the fact it applied, and the outbox rows,
-- status changes, webhooks and incidents with the same `xact` are that fact's effects. A step
-- with no inbox row was a request (a hold), a webhook (its stripe_events row) or a sweep
-- (expiry, reconcile). No statement is added to the purchase path: the column defaults fill it.
--
-- Columns are added without a default first and the default set after, so existing rows are
-- not rewritten (a volatile default on ADD COLUMN would rewrite the table under its lock).
ALTER TABLE outbox ADD COLUMN xact xid8;
ALTER TABLE outbox ALTER COLUMN xact SET DEFAULT pg_current_xact_id();
ALTER TABLE inbox ADD COLUMN xact xid8;
ALTER TABLE inbox ALTER COLUMN xact SET DEFAULT pg_current_xact_id();
ALTER TABLE stripe_events ADD COLUMN xact xid8;
ALTER TABLE stripe_events ALTER COLUMN xact SET DEFAULT pg_current_xact_id();
ALTER TABLE incidents ADD COLUMN xact xid8;
ALTER TABLE incidents ALTER COLUMN xact SET DEFAULT pg_current_xact_id();
ALTER TABLE order_history ADD COLUMN xact xid8;
CREATE INDEX incidents_order_idx ON incidents (order_id) WHERE order_id IS NOT NULL;
CREATE INDEX stripe_events_order_idx ON stripe_events (order_id) WHERE order_id IS NOT NULL;

-- Every change of an order's status, written by a row trigger so that no code path (the
-- saga, the ticket worker, the expiry sweep, an operator command) can move an order without
-- leaving its mark. Append-only; pruned with the order history.
CREATE TABLE order_transitions (
    order_id    uuid NOT NULL,
    from_status text NOT NULL,
    to_status   text NOT NULL,
    reason      text,
    at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    xact        xid8 NOT NULL DEFAULT pg_current_xact_id()
);
CREATE INDEX order_transitions_order_idx ON order_transitions (order_id, at);
CREATE INDEX order_transitions_at_idx ON order_transitions (at);

CREATE FUNCTION order_transition_record() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO order_transitions (order_id, from_status, to_status, reason)
    VALUES (NEW.id, OLD.status, NEW.status,
            CASE WHEN NEW.failure_reason IS DISTINCT FROM OLD.failure_reason THEN NEW.failure_reason END);
    RETURN NULL;
END $$;
CREATE TRIGGER orders_record_transition AFTER UPDATE OF status ON orders
    FOR EACH ROW WHEN (OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION order_transition_record();

CREATE TRIGGER order_transitions_region_fence BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON order_transitions
    FOR EACH STATEMENT EXECUTE FUNCTION region_fence_check();
