-- A ticket whose money went back (a full refund at the provider) is voided, never deleted:
-- the row keeps the seat (not resold unless an operator chooses to) and says why.
ALTER TABLE tickets
    ADD COLUMN voided_at   timestamptz,
    ADD COLUMN void_reason text,
    ADD CONSTRAINT tickets_void_reason_ck CHECK ((voided_at IS NULL) = (void_reason IS NULL));
