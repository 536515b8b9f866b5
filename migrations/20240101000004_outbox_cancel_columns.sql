-- outbox: the cancel mark, step 1 of 2 (SPEC §1.3, §3).
-- `cancelled_at` records that a cancel reached a row while its handler ran: however that
-- run ends, the row is deleted, never retried or archived (the cancel dropped any queued
-- rearm; an extend after it queues a new one and clears the mark). A nullable column
-- without a default: no table rewrite. The CHECK is added NOT VALID (a catalog change under
-- a lock held for milliseconds); the next step scans the rows.
ALTER TABLE "outbox"
    ADD COLUMN IF NOT EXISTS cancelled_at timestamptz;
DO $outbox$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint
                   WHERE conrelid = '"outbox"'::regclass AND conname = 'outbox_cancel_ck') THEN
        ALTER TABLE "outbox" ADD CONSTRAINT "outbox_cancel_ck"
            CHECK (cancelled_at IS NULL OR acquired_token IS NOT NULL) NOT VALID;
    END IF;
END
$outbox$;
