-- Case C19: the hold's lifetime rules (boxoffice_domain::hold). `expires_at` may be pushed
-- later by the payment window when the order becomes payable; `authorized_until` protects a
-- hold whose authorization the provider reported while it was live, until the saga settles
-- it; `payable_by` (created_at + the ceiling, cleared once payable) keeps a hold the pipeline
-- has not made payable yet. A hold is lapsed only when all three are past. The timestamps feed the release controller's
-- end-to-end signals and the onsale's outcome report.
ALTER TABLE holds
    ADD COLUMN payable_by                timestamptz,
    ADD COLUMN authorization_reported_at timestamptz,
    ADD COLUMN authorized_until          timestamptz,
    ADD COLUMN payable_at                timestamptz,
    ADD COLUMN confirmed_at              timestamptz;
