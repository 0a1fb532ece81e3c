DROP TABLE diesel_claim_jobs;
