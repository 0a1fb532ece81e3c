DROP TABLE diesel_claim_leases;
