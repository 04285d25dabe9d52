-- A row the producer refuses outright (larger than a message may be, a topic it cannot
-- send to) is parked (design §7): `refused_at` and `refusal` record the last refusal, and the
-- relay reads neither that row nor the later rows of its order until `relay_refused_retry_s`
-- has passed, or an operator's `boxoffice outbox retry` clears `refused_at`
-- (`boxoffice_store::outbox::pending_batch`). Before, a refused row was read again by every
-- batch, and as many refused rows as a batch holds stopped the relay for every order.
--
-- Nullable columns without a default: a change of the catalog only, no rewrite. A relay of
-- an older build ignores them (it reads a parked row again every batch, as it did).
ALTER TABLE outbox ADD COLUMN refused_at timestamptz, ADD COLUMN refusal text;
