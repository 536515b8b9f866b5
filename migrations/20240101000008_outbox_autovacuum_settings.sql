-- outbox: autovacuum settings for the queue table (docs/performance.md, "Autovacuum").
-- Every message is inserted, updated when claimed and deleted when acked; every extend and
-- every renewal writes a new row version. The defaults vacuum a table once 20 % of its live
-- rows are dead: with 100 000 live timers, 20 000 dead versions that every claim's index
-- scan walks over first. Here a vacuum starts after 1 000 dead versions plus 1 % of the live
-- rows, runs unthrottled (the table is hot and small next to what it churns), and the
-- statistics follow a burst of inserts after 1 000 rows plus 2 %. Storage parameters only:
-- a catalog change under a SHARE UPDATE EXCLUSIVE lock, which reads and writes do not wait
-- for. Applied once: an operator's later change to any of these is kept.
ALTER TABLE "outbox" SET (
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_insert_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.01,
    autovacuum_analyze_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);
