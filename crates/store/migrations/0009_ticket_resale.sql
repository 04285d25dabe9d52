-- A voided ticket keeps its seat (case C14: nothing is resold by default). An operator may
-- choose to put that seat back on sale (`boxoffice tickets resell`): the ticket row stays,
-- voided, with `seat_released_at` set, and the seat can then be held and ticketed again.
-- Invariant 1 becomes "one seat has at most one ticket that still holds it".
ALTER TABLE tickets
    ADD COLUMN seat_released_at timestamptz,
    ADD CONSTRAINT tickets_released_only_when_void_ck CHECK (seat_released_at IS NULL OR voided_at IS NOT NULL);

ALTER TABLE tickets DROP CONSTRAINT ticket_seat_uq;
CREATE UNIQUE INDEX ticket_seat_uq ON tickets (seat_id) WHERE seat_released_at IS NULL;
