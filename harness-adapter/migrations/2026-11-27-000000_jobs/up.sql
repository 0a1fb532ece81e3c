-- The queue: a job is a row, taken from the head (lowest id first) and
-- deleted in the transaction that ran it.
CREATE TABLE diesel_claim_jobs (
    id BIGSERIAL PRIMARY KEY,
    -- When the producer enqueued it, in microseconds since the Unix epoch:
    -- the start of its pickup latency.
    enqueued_at_us BIGINT NOT NULL,
    payload TEXT NOT NULL
);
