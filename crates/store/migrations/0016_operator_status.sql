-- What the operator's onsale dashboard (`GET /admin/onsale`, design §16) reads besides the
-- purchase tables: the release controller's last tick, and the results of `boxoffice audit`.

-- One row per purchase cell, upserted by the release controller's leader once per tick (the
-- holder of the cell's advisory lock): the rate R, what this tick did and why, when R last
-- moved and why, every signal with its threshold, and each queued event's share of R with
-- its queue and admissions. Rows of a cell whose leader stopped stay, with an old
-- `updated_at` (the dashboard shows it as stale).
CREATE TABLE release_status (
    cell           text PRIMARY KEY,
    rate_per_s     double precision NOT NULL,
    -- increase | hold | decrease (this tick's action).
    action         text NOT NULL CHECK (action IN ('increase', 'hold', 'decrease')),
    -- The signals behind this tick's action (over or failed for a decrease, soft for a hold).
    reasons        text[] NOT NULL DEFAULT '{}',
    -- The last tick whose rate differed from the one before, its action and its reasons.
    moved_at       timestamptz,
    moved_action   text CHECK (moved_action IN ('increase', 'hold', 'decrease')),
    moved_reasons  text[] NOT NULL DEFAULT '{}',
    -- [{"name", "value" (null when failed or off), "threshold", "state": ok|soft|over|failed|off}]
    -- plus {"consumer_lag_by_partition": [{"group", "partition", "lag"}]}.
    signals        jsonb NOT NULL,
    -- {event id: {"rate_per_s", "queued", "pre_queued", "admitted_live", "admitted_per_s",
    --  "admitted_total"}}: the events that had a queue this tick.
    event_rates    jsonb NOT NULL DEFAULT '{}',
    min_per_s      double precision NOT NULL,
    max_per_s      double precision NOT NULL,
    leader_since   timestamptz NOT NULL,
    updated_at     timestamptz NOT NULL
);

-- One row per `boxoffice audit` run (and per onsale report's audit): every violation count by
-- name (null: the check did not run), which checks ran, the business totals. The dashboard
-- and the API's `boxoffice_audit_*` gauges read the latest. Runs older than 90 days are
-- pruned by the insert.
CREATE TABLE audit_runs (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    started_at   timestamptz NOT NULL,
    finished_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The event the run was restricted to (`--event`); NULL: the whole ledger.
    event_id     uuid,
    violations   jsonb NOT NULL,
    total        bigint NOT NULL CHECK (total >= 0),
    exit_code    integer NOT NULL,
    checks       jsonb NOT NULL,
    totals       jsonb NOT NULL
);
CREATE INDEX audit_runs_finished_idx ON audit_runs (finished_at);

-- The dashboard's per-event rates and totals: holds (one order per hold) and tickets created
-- per event over a recent window, and their counts, read by index range scans.
CREATE INDEX order_event_created_idx ON orders (event_id, created_at);
CREATE INDEX ticket_event_issued_idx ON tickets (event_id, issued_at);

-- The region fence (0013) covers both like every other written table of the purchase
-- database: a fenced region's controller cannot publish a status, nor a fenced region's
-- `boxoffice audit` record a run, over the region that writes now (the audit still reports;
-- only its record is refused).
DO $$
DECLARE t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['release_status', 'audit_runs'] LOOP
        EXECUTE format('CREATE TRIGGER %I BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON %I
                        FOR EACH STATEMENT EXECUTE FUNCTION region_fence_check()',
                       t || '_region_fence', t);
    END LOOP;
END $$;
