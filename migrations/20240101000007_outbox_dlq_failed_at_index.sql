-- no-transaction
-- outbox: purges of dead letters by age (SPEC §1.2). Built CONCURRENTLY, outside a
-- transaction, so writes to the table go on during the build (it waits for every older
-- snapshot in the database first). An interrupted build leaves an INVALID index, which
-- `outbox::migrate` drops and builds again.
CREATE INDEX CONCURRENTLY IF NOT EXISTS "outbox_dlq_failed_at_idx" ON "outbox_dlq" (failed_at);
