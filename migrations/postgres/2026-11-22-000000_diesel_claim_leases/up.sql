-- Named leases of diesel-claim. A row outlives its lease so that the fencing
-- token keeps increasing across releases and expiries.
CREATE TABLE diesel_claim_leases (
    name TEXT PRIMARY KEY CHECK (name <> ''),
    token BIGINT NOT NULL CHECK (token > 0),
    expires_at TIMESTAMPTZ NOT NULL
);
