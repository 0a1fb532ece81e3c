-- Named leases of diesel-claim. A row outlives its lease so that the fencing
-- token keeps increasing across releases and expiries. Names are compared as
-- bytes (no collation folds case or pads spaces); `expires_at` is in
-- microseconds since the Unix epoch, by the server's clock.
-- IF NOT EXISTS: a database that applied this migration before the crate
-- kept its own history (diesel_claim_schema_migrations) has the table.
CREATE TABLE IF NOT EXISTS diesel_claim_leases (
    name VARBINARY(255) NOT NULL PRIMARY KEY CHECK (name <> ''),
    token BIGINT NOT NULL CHECK (token > 0),
    expires_at BIGINT NOT NULL
) ENGINE = InnoDB;
