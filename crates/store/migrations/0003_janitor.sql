-- Inbox rows only matter while a message can still be redelivered (the topic's retention);
-- the expiry role prunes older ones, found through this append-ordered BRIN index.
CREATE INDEX inbox_processed_brin ON inbox USING brin (processed_at);
