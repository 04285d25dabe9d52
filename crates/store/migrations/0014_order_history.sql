-- The business timeline (design §16).
--
-- The W3C trace context (`traceparent`) of the span that committed an outbox row; NULL when
-- tracing is off. The relay sends it as the message's `traceparent` header, so the consumer
-- continues the trace of the request or message that caused the fact.
ALTER TABLE outbox ADD COLUMN traceparent text;

-- Every fact of every order, kept after the outbox prunes it: the relay's prune moves
-- published rows here in the statement that deletes them, and drops rows older than the
-- history's retention. Append-only otherwise; `boxoffice timeline` and
-- `GET /admin/orders/{id}/timeline` read it together with the outbox.
CREATE TABLE order_history (
    event_id      uuid PRIMARY KEY,
    order_id      uuid NOT NULL,
    topic         text NOT NULL,
    event_type    text NOT NULL,
    payload       jsonb NOT NULL,
    created_at    timestamptz NOT NULL,
    published_at  timestamptz,
    region        text,
    region_epoch  bigint,
    traceparent   text,
    archived_at   timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX order_history_order_idx ON order_history (order_id, created_at);
CREATE INDEX order_history_created_idx ON order_history (created_at);

-- The region fence (0013) covers the history like every other purchase table.
CREATE TRIGGER order_history_region_fence BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON order_history
    FOR EACH STATEMENT EXECUTE FUNCTION region_fence_check();
