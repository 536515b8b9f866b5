-- outbox: the rearm upgrade, step 1 of 2 (SPEC §1.3).
-- Nullable columns without defaults: no table rewrite. The CHECK is added NOT VALID, so
-- the ACCESS EXCLUSIVE lock of ADD CONSTRAINT is held only for a catalog change; the scan
-- of existing rows happens in the next step under a weaker lock.
ALTER TABLE "outbox"
    ADD COLUMN IF NOT EXISTS rearm_at timestamptz,
    ADD COLUMN IF NOT EXISTS rearm_payload bytea,
    ADD COLUMN IF NOT EXISTS rearm_headers jsonb;
DO $outbox$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_constraint
                   WHERE conrelid = '"outbox"'::regclass AND conname = 'outbox_rearm_ck') THEN
        ALTER TABLE "outbox" ADD CONSTRAINT "outbox_rearm_ck"
            CHECK (rearm_at IS NULL OR acquired_token IS NOT NULL) NOT VALID;
    END IF;
END
$outbox$;
