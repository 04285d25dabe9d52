-- The region fence's checks (migration 0013) at a fraction of their cost, with the same rules.
--
-- Both functions ran as their owner (SECURITY DEFINER) with `SET search_path FROM CURRENT`:
-- PostgreSQL applies a function's SET clause on every call (a new GUC nest level, the search
-- path recomputed, the setting undone on return), and these functions are called by a
-- statement trigger on every write statement of every purchase transaction and by a deferred
-- trigger on every row of eight tables at commit. They now run as the caller, without SET.
--
-- They ran as the owner because the writer's lock was ROW SHARE on region_epoch, which
-- PostgreSQL 15 grants only to roles that may modify the table. The fence's lock is now a
-- transaction-scoped advisory lock, key pair (1113081393, 1) ('BXF1', 1;
-- `boxoffice_store::region::FENCE_LOCK`): a writer takes it
-- shared on its first write and holds it to commit, `boxoffice region fence` takes it
-- exclusive (crates/store/src/region.rs). They conflict exactly as ROW SHARE and EXCLUSIVE on
-- the table did — the fence waits for every transaction already past its first write, and
-- every writer that asks after the fence queues behind it (PostgreSQL queues a request behind
-- a waiting one it conflicts with) — while a plain reader of region_epoch (a report, a
-- pg_dump) takes no part and never holds the fence up. Any role may take an advisory lock;
-- reading the epoch and the lease mirror is granted to every role below, and moving them
-- still needs rights the application role does not have.
--
-- The lock stays a statement of its own before the read: a statement's snapshot is taken
-- before it waits, so only a read in a later statement sees the epoch a fence it waited for
-- has set. The tables are named with the schema the migration runs in, so a caller's
-- search_path (a temporary table of the same name, another schema first) cannot stand in for
-- them, without a SET clause.
GRANT SELECT ON region_epoch, region_lease TO PUBLIC;

DO $migration$
DECLARE
    s text := quote_ident(current_schema());
BEGIN
    EXECUTE format($f$
CREATE OR REPLACE FUNCTION %1$s.region_fence_check() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    writer text := current_setting('boxoffice.region_epoch', true);
    ledger bigint;
    lease record;
BEGIN
    IF writer IS NULL OR writer = '' THEN
        RETURN NULL;
    END IF;
    -- Checked already in this transaction (the mark is transaction-local, and undone with a
    -- rolled-back savepoint, whose lock is released too).
    IF current_setting('boxoffice.region_checked', true) = txid_current()::text THEN
        RETURN NULL;
    END IF;
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'region fence: purchase writes run at READ COMMITTED, not %%',
            current_setting('transaction_isolation') USING ERRCODE = 'BXF01';
    END IF;
    -- The fence's lock, shared: conflicts only with the fence; held to commit.
    PERFORM pg_catalog.pg_advisory_xact_lock_shared(1113081393, 1);
    SELECT epoch INTO ledger FROM %1$s.region_epoch;
    IF ledger IS DISTINCT FROM writer::bigint THEN
        RAISE EXCEPTION 'region fenced: this writer declares epoch %%, the ledger is at epoch %%', writer, ledger
            USING ERRCODE = 'BXF01';
    END IF;
    SELECT required, valid_until INTO lease FROM %1$s.region_lease;
    IF FOUND AND lease.required AND lease.valid_until <= clock_timestamp() THEN
        RAISE EXCEPTION 'region lease lapsed at %%', lease.valid_until USING ERRCODE = 'BXF02';
    END IF;
    PERFORM set_config('boxoffice.region_checked', txid_current()::text, true);
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION %1$s.region_lease_commit_check() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    lease record;
BEGIN
    IF nullif(current_setting('boxoffice.region_epoch', true), '') IS NULL
       OR current_setting('boxoffice.region_commit_checked', true) = txid_current()::text THEN
        RETURN NULL;
    END IF;
    SELECT required, valid_until INTO lease FROM %1$s.region_lease;
    IF FOUND AND lease.required AND lease.valid_until <= clock_timestamp() THEN
        RAISE EXCEPTION 'region lease lapsed at %% before this transaction committed', lease.valid_until
            USING ERRCODE = 'BXF02';
    END IF;
    PERFORM set_config('boxoffice.region_commit_checked', txid_current()::text, true);
    RETURN NULL;
END $$;
$f$, s);
END $migration$;
