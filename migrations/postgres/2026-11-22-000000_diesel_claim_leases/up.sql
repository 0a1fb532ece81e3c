-- Named leases of diesel-claim. A row outlives its lease so that the fencing
-- token keeps increasing across releases and expiries.
-- IF NOT EXISTS: a database that applied this migration before the crate
-- kept its own history (diesel_claim_schema_migrations) has the table.
CREATE TABLE IF NOT EXISTS diesel_claim_leases (
    name TEXT PRIMARY KEY CHECK (name <> ''),
    token BIGINT NOT NULL CHECK (token > 0),
    expires_at TIMESTAMPTZ NOT NULL
);
