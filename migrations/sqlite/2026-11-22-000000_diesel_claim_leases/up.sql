-- Named leases of diesel-claim. A row outlives its lease so that the fencing
-- token keeps increasing across releases and expiries. `expires_at` is in
-- microseconds since the Unix epoch, by SQLite's clock.
CREATE TABLE diesel_claim_leases (
    name TEXT PRIMARY KEY NOT NULL CHECK (name <> ''),
    token INTEGER NOT NULL CHECK (token > 0),
    expires_at INTEGER NOT NULL
);
