-- outbox: paused queues (SPEC §1, §8).
-- One row per paused queue: a claim finds no row of a queue listed here, publishing goes on.
-- The claim reads this table inside its one statement, so a pause holds from the next claim
-- on. A new table: creating it takes no lock on the queue table.
CREATE TABLE IF NOT EXISTS "outbox_paused" (
    queue varchar(255) PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now()
);
