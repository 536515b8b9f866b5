-- outbox: dead-letter redrive (SPEC §1.2).
-- When a dead letter is re-published, `redriven_at` and `redriven_id` (the new queue row)
-- link it to its new life, so a row is redriven once. Nullable columns without defaults:
-- no table rewrite, a catalog change under a lock held for milliseconds.
ALTER TABLE "outbox_dlq"
    ADD COLUMN IF NOT EXISTS redriven_at timestamptz,
    ADD COLUMN IF NOT EXISTS redriven_id bigint;
