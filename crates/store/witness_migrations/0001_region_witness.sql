-- The region witness (design §15): a database outside every region that says which region
-- may write and at which epoch, and the leases each region's processes hold. A process that
-- cannot renew its lease here within the lease's TTL stops writing; the fence changes the
-- authority here first, so a region cut off from the witness fences itself.
CREATE TABLE region_authority (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    region text NOT NULL CHECK (region <> ''),
    epoch bigint NOT NULL CHECK (epoch > 0),
    changed_at timestamptz NOT NULL DEFAULT now(),
    changed_by text,
    -- Set by a fence: by the witness's clock, every lease of an older epoch has lapsed (plus
    -- the skew margin) at this instant; promotion waits for it.
    writers_clear_at timestamptz,
    -- The recovery point the fence read off the replica it is about to promote.
    recovery_lsn pg_lsn,
    recovery_point_at timestamptz,
    -- The old primary's WAL position, when the fence could reach it.
    old_primary_lsn pg_lsn
);

CREATE TABLE region_leases (
    holder text PRIMARY KEY,
    region text NOT NULL,
    epoch bigint NOT NULL,
    renewed_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL
);
