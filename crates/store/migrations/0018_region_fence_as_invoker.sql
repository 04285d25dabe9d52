-- The region fence's checks (migration 0013) at a fraction of their cost, with the same rules.
--
-- Both functions ran as their owner (SECURITY DEFINER) with `SET search_path FROM CURRENT`:
-- PostgreSQL applies a function's SET clause on every call (a new GUC nest level, the search
-- path recomputed, the setting undone on return), and these functions are called by a
-- statement trigger on every write statement of every purchase transaction and by a deferred
-- trigger on every row of eight tables at commit. They now run as the caller, without SET.
--
-- They ran as the owner because the writer's lock was ROW SHARE, which PostgreSQL 15 grants
-- only to roles that may modify the table. The writer now takes region_epoch in ACCESS SHARE
-- mode (the lock any SELECT takes, granted with SELECT) and the fence takes ACCESS EXCLUSIVE
-- (crates/store/src/region.rs): the two conflict exactly as ROW SHARE and EXCLUSIVE did — the
-- fence waits for every transaction already past its first write, and every writer that asks
-- after the fence queues behind it — so the application role needs SELECT on region_epoch and
-- region_lease, and still no right to move the epoch.
--
-- The lock stays a statement of its own before the read: a statement's snapshot is taken
-- before its locks, so only a read in a later statement sees the epoch a fence it waited for
-- has set.
CREATE OR REPLACE FUNCTION region_fence_check() RETURNS trigger LANGUAGE plpgsql AS $$
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
        RAISE EXCEPTION 'region fence: purchase writes run at READ COMMITTED, not %',
            current_setting('transaction_isolation') USING ERRCODE = 'BXF01';
    END IF;
    -- Conflicts only with the fence's ACCESS EXCLUSIVE lock; held to commit.
    LOCK TABLE region_epoch IN ACCESS SHARE MODE;
    SELECT epoch INTO ledger FROM region_epoch;
    IF ledger IS DISTINCT FROM writer::bigint THEN
        RAISE EXCEPTION 'region fenced: this writer declares epoch %, the ledger is at epoch %', writer, ledger
            USING ERRCODE = 'BXF01';
    END IF;
    SELECT required, valid_until INTO lease FROM region_lease;
    IF FOUND AND lease.required AND lease.valid_until <= clock_timestamp() THEN
        RAISE EXCEPTION 'region lease lapsed at %', lease.valid_until USING ERRCODE = 'BXF02';
    END IF;
    PERFORM set_config('boxoffice.region_checked', txid_current()::text, true);
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION region_lease_commit_check() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    lease record;
BEGIN
    IF nullif(current_setting('boxoffice.region_epoch', true), '') IS NULL
       OR current_setting('boxoffice.region_commit_checked', true) = txid_current()::text THEN
        RETURN NULL;
    END IF;
    SELECT required, valid_until INTO lease FROM region_lease;
    IF FOUND AND lease.required AND lease.valid_until <= clock_timestamp() THEN
        RAISE EXCEPTION 'region lease lapsed at % before this transaction committed', lease.valid_until
            USING ERRCODE = 'BXF02';
    END IF;
    PERFORM set_config('boxoffice.region_commit_checked', txid_current()::text, true);
    RETURN NULL;
END $$;
