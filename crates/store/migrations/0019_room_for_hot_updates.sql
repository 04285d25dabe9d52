-- Room on each page for the updates the purchase path makes to rows it just wrote (design §12).
--
-- An update that changes no indexed column, and finds room on the row's own page, is a HOT
-- update: PostgreSQL writes no new index entries for it and prunes the old version on the
-- page. Full pages (the default fillfactor, 100) turn every such update into a new row
-- version elsewhere with an entry in every index. Per ticketed order:
-- - payments: about four updates (mirrored status, capture deadline, amounts), none of an
--   indexed column (the indexes are the order and the PaymentIntent id);
-- - holds: the authorization's protection (authorization_reported_at, authorized_until);
--   status and expiry changes still move the row (the expiry index covers them);
-- - outbox: the relay's claim (claimed_by, claim_expires_at, publish_attempts);
-- - idempotency_keys: the stored answer, written after the key is claimed.
-- Only pages written from now on keep the room; existing rows are not rewritten.
ALTER TABLE payments SET (fillfactor = 70);
ALTER TABLE holds SET (fillfactor = 80);
ALTER TABLE outbox SET (fillfactor = 80);
ALTER TABLE idempotency_keys SET (fillfactor = 80);
