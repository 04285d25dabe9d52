-- Each completed `boxoffice reconcile` run (design §16, "Stripe/local status mismatch"): the
-- drift it left unresolved per kind (every kind, 0 when none). The API role exports the latest
-- as `boxoffice_reconcile_drift{kind}` and `boxoffice_reconcile_last_run_timestamp_seconds`,
-- so the alert rules see a one-off command's result. Pruned with the audit runs (90 days).
CREATE TABLE reconcile_runs (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    finished_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    since        timestamptz NOT NULL,
    until        timestamptz,
    unresolved   jsonb NOT NULL,
    fixed        bigint NOT NULL CHECK (fixed >= 0)
);
CREATE INDEX reconcile_runs_finished_idx ON reconcile_runs (finished_at);

CREATE TRIGGER reconcile_runs_region_fence BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON reconcile_runs
    FOR EACH STATEMENT EXECUTE FUNCTION region_fence_check();
