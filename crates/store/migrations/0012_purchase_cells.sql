-- Purchase cells (design §13). Each cell's ledger says which cell sells each of its events,
-- at which directory epoch, and whether this ledger may take holds for it: the hold
-- transaction reads these on the event row it already reads, so a token routed by a stale
-- directory or to the wrong cell is refused where the seats are.
ALTER TABLE events
    ADD COLUMN directory_epoch bigint NOT NULL DEFAULT 1 CHECK (directory_epoch > 0),
    -- active: this ledger sells the event; frozen: a move is under way (no new holds, open
    -- orders settle); moved: another cell sells it now (`purchase_cell`, `directory_epoch`).
    ADD COLUMN cell_state text NOT NULL DEFAULT 'active' CHECK (cell_state IN ('active', 'frozen', 'moved'));

-- A seat sold (or held for good) by another cell's ledger before the event moved here: its
-- orders and tickets stay in that cell, so this ledger only knows it is not for sale.
ALTER TABLE seats ADD COLUMN sold_in_cell text;
