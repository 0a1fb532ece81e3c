-- Named leases of diesel-claim. A row outlives its lease so that the fencing
-- token keeps increasing across releases and expiries. Names are compared as
-- bytes (no collation folds case or pads spaces); `expires_at` is in
-- microseconds since the Unix epoch, by the server's clock.
CREATE TABLE diesel_claim_leases (
    name VARBINARY(255) NOT NULL PRIMARY KEY CHECK (name <> ''),
    token BIGINT NOT NULL CHECK (token > 0),
    expires_at BIGINT NOT NULL
) ENGINE = InnoDB;
