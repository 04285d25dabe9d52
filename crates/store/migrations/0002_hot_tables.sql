-- The purchase path churns a few tables hard during an onsale (rows inserted, updated and
-- released within minutes). PostgreSQL's default autovacuum thresholds (20 % of the table)
-- let dead tuples and stale statistics pile up until plans go wrong mid-onsale, so these
-- tables are vacuumed and analyzed after ~2 % change instead.
ALTER TABLE hold_seats SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);
ALTER TABLE holds SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);
ALTER TABLE orders SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);
ALTER TABLE payments SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.02);
ALTER TABLE tickets SET (autovacuum_analyze_scale_factor = 0.02);
ALTER TABLE outbox SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_analyze_scale_factor = 0.02);
ALTER TABLE inbox SET (autovacuum_analyze_scale_factor = 0.02);
ALTER TABLE idempotency_keys SET (autovacuum_analyze_scale_factor = 0.02);

-- The relay prunes published rows by age; a BRIN index on the append-only creation time
-- finds them for almost no upkeep.
CREATE INDEX outbox_created_brin ON outbox USING brin (created_at);
