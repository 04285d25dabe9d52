-- Per-event buyer limits (checked inside the hold transaction against the ledger) and the
-- sales window (the opening decided by PostgreSQL, never by the waiting room's cache).

ALTER TABLE events
    ADD COLUMN max_seats_per_buyer        integer NOT NULL DEFAULT 8 CHECK (max_seats_per_buyer > 0),
    ADD COLUMN max_active_holds_per_buyer integer NOT NULL DEFAULT 1 CHECK (max_active_holds_per_buyer > 0),
    -- NULL: not on sale (never scheduled).
    ADD COLUMN sales_open_at              timestamptz,
    ADD COLUMN sales_close_at             timestamptz,
    ADD CONSTRAINT events_sales_window_ck CHECK (sales_close_at IS NULL OR sales_open_at IS NULL OR sales_close_at > sales_open_at);

-- Events are found by name when seeding (ids are random, not derived from the name).
CREATE UNIQUE INDEX events_name_uq ON events (name);

-- What one buyer has in one event: the hold transaction's cap check.
CREATE INDEX order_buyer_idx ON orders (event_id, user_id);
