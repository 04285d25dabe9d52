-- Two indexes no query reads, dropped: each cost every purchase index writes (design §12).
--
-- - hold_seat_lookup_idx (hold_seats.seat_id, every row): every read of a seat's hold asks
--   for the unreleased one (`released_at IS NULL`), which hold_seat_active_uq answers (the
--   hold transaction's owner query, the seat map, the audit, a cell move). It cost two entries
--   per hold of two seats, and two more when the hold was released (that update changes the
--   partial index's predicate column, so it is never HOT). Without it a DELETE of a seat would
--   scan hold_seats for the foreign key; seats are never deleted.
-- - order_user_idx (orders.user_id, created_at): no statement looks orders up by buyer alone;
--   a buyer's orders of one event (the hold's limits) use order_buyer_idx (event_id, user_id).
--   It cost one entry per order and one per status change (status is order_open_idx's
--   column, so those updates are never HOT): about six per ticketed order.
DROP INDEX IF EXISTS hold_seat_lookup_idx;
DROP INDEX IF EXISTS order_user_idx;
