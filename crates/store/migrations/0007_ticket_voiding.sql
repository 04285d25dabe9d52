-- A ticket whose money went back (a full refund at the provider, a lost dispute) is voided,
-- never deleted: the row keeps the seat (not resold unless an operator chooses to) and says
-- why. A ticket under an open dispute is flagged.
ALTER TABLE tickets
    ADD COLUMN voided_at   timestamptz,
    ADD COLUMN void_reason text,
    ADD COLUMN disputed_at timestamptz,
    ADD CONSTRAINT tickets_void_reason_ck CHECK ((voided_at IS NULL) = (void_reason IS NULL));

-- The provider's last word on a dispute of the order's charge (`needs_response`, `won`, `lost`, …).
ALTER TABLE payments
    ADD COLUMN dispute_id     text,
    ADD COLUMN dispute_status text;

-- What an open dispute does to the event's tickets: `keep` them valid (flagged), or `void`
-- them until the dispute is won.
ALTER TABLE events
    ADD COLUMN dispute_policy text NOT NULL DEFAULT 'keep' CHECK (dispute_policy IN ('keep', 'void'));
