-- outbox: the base shape (SPEC §1.1, §1.2), without the rearm columns.
-- Every row is updated once by its claim; free space on its page (fillfactor 70) keeps the
-- new version on the same page, which logs a small diff instead of the whole row.
CREATE TABLE IF NOT EXISTS "outbox" (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue varchar(255) NOT NULL,
    payload bytea NOT NULL,
    headers jsonb,
    attempts_count integer NOT NULL DEFAULT 0,
    deliveries_count integer NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now(),
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    first_attempt_at timestamptz,
    last_attempt_at timestamptz,
    acquired_at timestamptz,
    acquired_token uuid,
    timer_id varchar(255),
    CONSTRAINT "outbox_lease_ck" CHECK ((acquired_token IS NULL) = (acquired_at IS NULL))
) WITH (fillfactor = 70);
-- The claim of due rows.
CREATE INDEX IF NOT EXISTS "outbox_pending_idx" ON "outbox" (queue, next_attempt_at) WHERE acquired_token IS NULL;
-- The reclaim of expired leases.
CREATE INDEX IF NOT EXISTS "outbox_lease_idx" ON "outbox" (queue, acquired_at) WHERE acquired_token IS NOT NULL;
-- One live row per timer key.
CREATE UNIQUE INDEX IF NOT EXISTS "outbox_timer_id_uq" ON "outbox" (queue, timer_id) WHERE timer_id IS NOT NULL;

CREATE TABLE IF NOT EXISTS "outbox_dlq" (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    original_id bigint NOT NULL,
    queue varchar(255) NOT NULL,
    payload bytea NOT NULL,
    headers jsonb,
    timer_id varchar(255),
    attempts_count integer NOT NULL,
    deliveries_count integer NOT NULL,
    created_at timestamptz NOT NULL,
    failed_at timestamptz NOT NULL DEFAULT now(),
    failure_reason varchar(64) NOT NULL,
    last_error text
);
CREATE INDEX IF NOT EXISTS "outbox_dlq_queue_failed_at_idx" ON "outbox_dlq" (queue, failed_at);
