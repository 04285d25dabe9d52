-- Rule 3 of boxoffice_domain::hold: a payable hold at its end, whose PaymentIntent the ledger
-- knows no authorization of, waits for the provider's word until `provider_check_until`
-- (set once, when the expiry worker asks for the re-fetch; pulled back to the answer's time
-- when the answer is not an authorization). A hold is lapsed only when every end is past.
ALTER TABLE holds ADD COLUMN provider_check_until timestamptz;
ALTER TABLE holds ADD COLUMN provider_check_requested_at timestamptz;
