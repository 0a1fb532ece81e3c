-- The queue: a job is a row, taken from the head (lowest id first) and
-- deleted in the transaction that ran it. The table is partitioned by
-- `slot` into the ring of partitions the adapter's `Ring` adds at start
-- (with the slot's default): a slot whose jobs are all done is truncated,
-- its dead rows with it, however long vacuum is held back.
CREATE TABLE diesel_claim_jobs (
    id BIGSERIAL,
    slot SMALLINT NOT NULL,
    -- When the producer enqueued it, in microseconds since the Unix epoch:
    -- the start of its pickup latency.
    enqueued_at_us BIGINT NOT NULL,
    payload TEXT NOT NULL,
    PRIMARY KEY (id, slot)
) PARTITION BY LIST (slot);
