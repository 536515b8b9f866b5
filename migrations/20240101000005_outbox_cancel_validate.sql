-- outbox: the cancel mark, step 2 of 2 (SPEC §1.3).
-- Its own transaction: VALIDATE scans the table under SHARE UPDATE EXCLUSIVE, which lets
-- reads and writes go on.
ALTER TABLE "outbox" VALIDATE CONSTRAINT "outbox_cancel_ck";
