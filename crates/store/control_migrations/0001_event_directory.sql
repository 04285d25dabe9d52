-- The event directory (design §13): the control database's one table, owned by no cell.
-- Which purchase cell sells each event, at which epoch. The epoch grows by one on every move,
-- and admission tokens carry it, so a token minted before a move is refused after it.
CREATE TABLE event_directory (
    event_id        uuid PRIMARY KEY,
    cell            text NOT NULL,
    directory_epoch bigint NOT NULL CHECK (directory_epoch > 0),
    state           text NOT NULL CHECK (state IN ('active', 'moving')),
    -- The target of a move under way (state = 'moving').
    moving_to       text,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT event_directory_moving_ck CHECK ((state = 'moving') = (moving_to IS NOT NULL))
);
