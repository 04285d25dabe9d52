-- idempotency_keys back to full pages (design §12). Migration 0019 left a fifth of each page
-- free for the stored answer, which the hold wrote as an update after claiming the key. The
-- hold now inserts the key once, with its answer (`holds::insert_hold`), and never updates
-- it, so the room only made the table and its checkpoints' page images larger (an older
-- build's update during a rolling upgrade is then no longer HOT, nothing more). Pages written
-- from now on are filled; a brief SHARE UPDATE EXCLUSIVE lock, which no hold waits for.
ALTER TABLE idempotency_keys SET (fillfactor = 100);
