-- boxoffice's inventory and purchase ledger (design §4). PostgreSQL is authoritative:
-- ownership of a seat is a row here (hold_seats while held, tickets once sold), guarded by
-- unique indexes, never a flag in a cache.

CREATE TABLE events (
    id            uuid PRIMARY KEY,
    name          text NOT NULL,
    venue         text NOT NULL,
    starts_at     timestamptz NOT NULL,
    purchase_cell text NOT NULL DEFAULT 'cell-1',
    created_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE seats (
    id          uuid PRIMARY KEY,
    event_id    uuid NOT NULL REFERENCES events (id),
    label       text NOT NULL,
    section     text NOT NULL,
    row_label   text NOT NULL,
    seat_number integer NOT NULL,
    price_level text NOT NULL,
    price_minor bigint NOT NULL CHECK (price_minor >= 0),
    currency    text NOT NULL,
    CONSTRAINT seat_event_label_uq UNIQUE (event_id, label)
);
CREATE INDEX seat_event_idx ON seats (event_id, section, row_label, seat_number);

CREATE TABLE orders (
    id             uuid PRIMARY KEY,
    user_id        uuid NOT NULL,
    event_id       uuid NOT NULL REFERENCES events (id),
    status         text NOT NULL CHECK (status IN ('held', 'payment_required', 'confirming',
                        'paid', 'ticketed', 'expired', 'failed', 'canceled', 'refunding', 'refunded')),
    amount_minor   bigint NOT NULL CHECK (amount_minor >= 0),
    currency       text NOT NULL,
    failure_reason text,
    correlation_id uuid NOT NULL,
    version        integer NOT NULL DEFAULT 0,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX order_user_idx ON orders (user_id, created_at);
CREATE INDEX order_open_idx ON orders (status)
    WHERE status NOT IN ('ticketed', 'expired', 'failed', 'canceled', 'refunded');

CREATE TABLE holds (
    id         uuid PRIMARY KEY,
    order_id   uuid NOT NULL UNIQUE REFERENCES orders (id),
    status     text NOT NULL CHECK (status IN ('active', 'confirmed', 'expired', 'released')),
    expires_at timestamptz NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX hold_expiry_idx ON holds (expires_at) WHERE status = 'active';

CREATE TABLE hold_seats (
    hold_id     uuid NOT NULL REFERENCES holds (id),
    seat_id     uuid NOT NULL REFERENCES seats (id),
    released_at timestamptz,
    PRIMARY KEY (hold_id, seat_id)
);
CREATE INDEX hold_seat_lookup_idx ON hold_seats (seat_id);
-- Invariant 1: one seat has at most one active hold. The final guard, not a preflight query.
CREATE UNIQUE INDEX hold_seat_active_uq ON hold_seats (seat_id) WHERE released_at IS NULL;

CREATE TABLE payments (
    order_id          uuid PRIMARY KEY REFERENCES orders (id),
    payment_intent_id text NOT NULL UNIQUE,
    client_secret     text,
    status            text NOT NULL,
    amount_minor      bigint NOT NULL,
    currency          text NOT NULL,
    amount_captured_minor bigint NOT NULL DEFAULT 0,
    amount_refunded_minor bigint NOT NULL DEFAULT 0,
    capture_before    timestamptz,
    last_error_code   text,
    -- Set once when the saga first asks to cancel this authorization: one cancel suffices,
    -- whichever of expiry or a late authorization asks first.
    cancel_requested_at timestamptz,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE tickets (
    id        uuid PRIMARY KEY,
    order_id  uuid NOT NULL REFERENCES orders (id),
    seat_id   uuid NOT NULL REFERENCES seats (id),
    event_id  uuid NOT NULL REFERENCES events (id),
    issued_at timestamptz NOT NULL DEFAULT now(),
    -- Invariant 1: one seat has at most one ticket.
    CONSTRAINT ticket_seat_uq UNIQUE (seat_id),
    CONSTRAINT ticket_order_seat_uq UNIQUE (order_id, seat_id)
);

-- Invariant 3: one (user, Idempotency-Key) names one request and one original response.
CREATE TABLE idempotency_keys (
    user_id         uuid NOT NULL,
    idempotency_key text NOT NULL,
    request_hash    text NOT NULL,
    order_id        uuid,
    response_status smallint,
    response        jsonb,
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL,
    PRIMARY KEY (user_id, idempotency_key)
);
CREATE INDEX idempotency_expiry_idx ON idempotency_keys (expires_at);

-- Invariant 5: a committed business write is eventually published.
CREATE TABLE outbox (
    id               uuid PRIMARY KEY,
    topic            text NOT NULL,
    message_key      text NOT NULL,
    event_type       text NOT NULL,
    payload          jsonb NOT NULL,
    claimed_by       text,
    claim_expires_at timestamptz,
    published_at     timestamptz,
    publish_attempts integer NOT NULL DEFAULT 0,
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX outbox_pending_idx ON outbox (created_at) WHERE published_at IS NULL;
CREATE INDEX outbox_key_idx ON outbox (message_key);

-- Invariant 4: a message delivered twice has one effect (per consumer).
CREATE TABLE inbox (
    consumer     text NOT NULL,
    event_id     uuid NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- Invariant 4 for Stripe: one row per Stripe event id.
CREATE TABLE stripe_events (
    id                uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    stripe_event_id   text NOT NULL UNIQUE,
    type              text NOT NULL,
    payment_intent_id text,
    order_id          uuid,
    received_at       timestamptz NOT NULL DEFAULT now()
);

-- Money that moved for an order that could not be fulfilled, or other drift worth a human look.
CREATE TABLE incidents (
    id         uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    order_id   uuid,
    kind       text NOT NULL,
    detail     jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now()
);
