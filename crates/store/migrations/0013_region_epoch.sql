-- Warm-region failover (design §15, §17): the region epoch that fences writers.
--
-- `region_epoch` is this ledger's one epoch record: which region may write it, at which
-- epoch. Every purchase-path process declares its epoch on its session
-- (`boxoffice.region_epoch`, set in the connection's startup options); the trigger below
-- compares it with this row on the first write statement of each transaction to the
-- purchase tables, under a share lock on the table held to commit (so the record cannot
-- change before the transaction ends, and later statements need no check), and refuses a
-- mismatch with SQLSTATE BXF01. `boxoffice region fence`
-- takes the table in EXCLUSIVE mode (it waits only for transactions already past their
-- first write, and new writers queue behind it), bumps the epoch and records the WAL
-- position before which every commit of the old epoch lies.
--
-- `region_lease` mirrors the lease the region's processes hold from a witness outside the
-- region: once a process has renewed it (`required`), writes are refused with SQLSTATE
-- BXF02 when `valid_until` has passed by this database's clock. A returning old primary
-- whose processes can no longer renew therefore refuses its own writers even though its
-- epoch record was never fenced.
--
-- Sessions that declare no epoch (migrations, operator tools, tests' fixtures) are not
-- purchase-path writers and are not checked.
CREATE TABLE region_epoch (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    region text NOT NULL DEFAULT 'primary' CHECK (region <> ''),
    epoch bigint NOT NULL DEFAULT 1 CHECK (epoch > 0),
    -- When and by whom the epoch last moved, and the WAL insert position taken while the
    -- fence held the table: every commit under an older epoch lies before it.
    changed_at timestamptz NOT NULL DEFAULT now(),
    changed_by text,
    fence_lsn pg_lsn
);
INSERT INTO region_epoch DEFAULT VALUES;

CREATE TABLE region_lease (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    required boolean NOT NULL DEFAULT false,
    region text NOT NULL,
    epoch bigint NOT NULL CHECK (epoch > 0),
    valid_until timestamptz NOT NULL
);

-- Outbox rows carry the region and epoch of the session that wrote them (the same values the
-- trigger checked); the relay stamps them on the envelope and its headers.
ALTER TABLE outbox
    ADD COLUMN region text DEFAULT nullif(current_setting('boxoffice.region', true), ''),
    ADD COLUMN region_epoch bigint DEFAULT nullif(current_setting('boxoffice.region_epoch', true), '')::bigint;

-- SECURITY DEFINER: the lock needs more than SELECT on region_epoch, which the application
-- role must not have (it could move the epoch); the function runs as the migrating owner
-- and reads the session's declared epoch all the same.
CREATE FUNCTION region_fence_check() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path FROM CURRENT AS $$
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
    -- The read below must see the record as of the lock: a snapshot taken earlier (REPEATABLE
    -- READ, SERIALIZABLE) could show the epoch a fence has since moved.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'region fence: purchase writes run at READ COMMITTED, not %',
            current_setting('transaction_isolation') USING ERRCODE = 'BXF01';
    END IF;
    -- ROW SHARE conflicts only with the fence's EXCLUSIVE lock; held to commit. The read
    -- below takes its snapshot after the lock is granted (READ COMMITTED, which every
    -- purchase-path transaction uses), so a writer that waited for a fence sees its epoch.
    LOCK TABLE region_epoch IN ROW SHARE MODE;
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

DO $$
DECLARE t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['events', 'seats', 'holds', 'hold_seats', 'orders', 'payments', 'tickets',
                             'idempotency_keys', 'outbox', 'inbox', 'stripe_events', 'incidents',
                             'admission_revocations'] LOOP
        EXECUTE format('CREATE TRIGGER %I BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON %I
                        FOR EACH STATEMENT EXECUTE FUNCTION region_fence_check()',
                       t || '_region_fence', t);
    END LOOP;
END $$;

-- The lease again at commit: a transaction checked on its first write may wait on row locks
-- or run more statements before it commits, so a deferred constraint trigger re-reads the
-- lease mirror when the commit begins (once per transaction) and refuses with BXF02 once it
-- has lapsed. Every purchase transaction writes at least one of these tables (the hold and
-- expiry paths holds and outbox, consumers inbox, webhooks stripe_events; the event changes of
-- moves and limits events; revocations admission_revocations); the rows of the others in the
-- same transactions need no second queued check.
CREATE FUNCTION region_lease_commit_check() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path FROM CURRENT AS $$
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

DO $$
DECLARE t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['outbox', 'inbox', 'stripe_events', 'holds', 'payments', 'tickets',
                             'events', 'admission_revocations'] LOOP
        EXECUTE format('CREATE CONSTRAINT TRIGGER %I AFTER INSERT OR UPDATE OR DELETE ON %I
                        DEFERRABLE INITIALLY DEFERRED
                        FOR EACH ROW EXECUTE FUNCTION region_lease_commit_check()',
                       t || '_region_lease_at_commit', t);
    END LOOP;
END $$;
