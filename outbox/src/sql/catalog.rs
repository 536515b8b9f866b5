//! Catalog reads of `validate_schema` and `migrate()`. Static: they
//! take the table as a bind parameter, not as text. Reading the catalog takes no lock on
//! the tables it describes, except where Postgres prints an expression with the table's
//! column names (`pg_get_expr` of an index predicate, `pg_get_constraintdef` of a CHECK):
//! that opens the table with an ACCESS SHARE lock, the lock of a `SELECT`, which waits
//! behind an ACCESS EXCLUSIVE lock held or queued by another session.

/// `$1` qualified table name → its oid, or NULL when it does not exist.
pub(crate) const TABLE_OID: &str = "SELECT to_regclass($1)::oid::bigint";

/// `$1` a quoted, qualified table name → `(exists, has acquired_token)`: `acquired_token`
/// is a column every version's queue table has and no other table of the outbox's.
pub(crate) const QUEUE_TABLE_FOUND: &str = "SELECT to_regclass($1) IS NOT NULL, \
     EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) \
     AND attname = 'acquired_token' AND attnum > 0 AND NOT attisdropped)";

/// `$1` a quoted schema name → whether it exists (`to_regnamespace` is NULL for a missing
/// schema, where `to_regclass` of a table in it is just NULL too).
pub(crate) const SCHEMA_EXISTS: &str = "SELECT to_regnamespace($1) IS NOT NULL";

/// The server's `server_version` (as it prints it, `18.4 (Debian 18.4-1)`) and
/// `server_version_num` (`180004`), both text: the version check of `migrate()` and
/// `validate_schema`.
pub(crate) const SERVER_VERSION: &str =
    "SELECT current_setting('server_version'), current_setting('server_version_num')";

/// `$1` table oid → the names of the storage parameters the table sets (`reloptions`).
pub(crate) const STORAGE_PARAMETERS: &str = r#"
SELECT split_part(o, '=', 1)
FROM pg_class, unnest(coalesce(reloptions, '{}')) AS o
WHERE oid = $1::bigint::oid"#;

/// `$1` table oid → `(column, format_type, NOT NULL)` of every live column.
pub(crate) const COLUMNS: &str = r#"
SELECT attname::text, format_type(atttypid, atttypmod), attnotnull
FROM pg_attribute
WHERE attrelid = $1::bigint::oid AND attnum > 0 AND NOT attisdropped"#;

/// `$1` qualified table name → `(key columns in order, unique, partial predicate, valid,
/// name)` of every index. An index is not valid (`indisvalid` false) while a
/// `CREATE INDEX CONCURRENTLY` builds it, and for good when that build was interrupted.
pub(crate) const INDEXES: &str = r#"
SELECT array(SELECT a.attname::text
             FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
             ORDER BY k.ord),
       i.indisunique, pg_get_expr(i.indpred, i.indrelid), i.indisvalid, c.relname::text
FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE i.indrelid = to_regclass($1)"#;

/// `$1` qualified table name → `(definition, validated)` of every CHECK constraint.
pub(crate) const CHECKS: &str = r#"
SELECT pg_get_constraintdef(oid), convalidated FROM pg_constraint
WHERE conrelid = to_regclass($1) AND contype = 'c'"#;

/// `$1 bigint[]` table oids, `$2` the migrators' advisory lock key → `(pid, transaction
/// start, state, mode)` of the other sessions holding a lock on those tables, or that lock
/// (mode `advisory`: another `migrate()`): who a migration step waits for. A bigint
/// advisory key shows in `pg_locks` split into `classid` (high half) and `objid` (low half).
pub(crate) const LOCK_HOLDERS: &str = r#"
SELECT DISTINCT a.pid, a.xact_start, a.state,
       CASE WHEN l.locktype = 'advisory' THEN 'advisory' ELSE l.mode END
FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.granted AND l.pid <> pg_backend_pid()
  AND (l.relation = ANY($1::bigint[]::oid[])
       OR (l.locktype = 'advisory' AND l.objsubid = 1
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND ((l.classid::bigint << 32) | l.objid::bigint) = hashtextextended($2, 0)))
ORDER BY a.pid"#;

/// `(pid, transaction start, state, 'snapshot')` of the other sessions of this database that
/// hold a snapshot: who a `CREATE INDEX CONCURRENTLY` waits for (it waits for every
/// transaction older than its build, whatever tables they use).
pub(crate) const SNAPSHOT_HOLDERS: &str = r#"
SELECT a.pid, a.xact_start, a.state, 'snapshot'::text
FROM pg_stat_activity a
WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
  AND a.backend_xmin IS NOT NULL
ORDER BY a.xact_start NULLS LAST, a.pid
LIMIT 20"#;

/// `$1` qualified table name → `(server autovacuum off, table autovacuum off)`: the
/// `autovacuum` setting and the table's `autovacuum_enabled` reloption (absent = on).
/// Without autovacuum a queue table, whose rows are all inserted, updated and deleted
/// within minutes, keeps every dead row version and index entry until a manual VACUUM.
/// `option_value::bool` reads every spelling Postgres accepts (`false`, `off`, `0`, `no`).
pub(crate) const AUTOVACUUM_OFF: &str = r#"
SELECT to_regclass($1) IS NOT NULL,
       NOT current_setting('autovacuum')::bool,
       coalesce((SELECT NOT o.option_value::bool
                 FROM pg_class c, pg_options_to_table(c.reloptions) o
                 WHERE c.oid = to_regclass($1) AND o.option_name = 'autovacuum_enabled'),
                false)"#;

/// Whether the Citus extension is installed in this database.
pub(crate) const CITUS_INSTALLED: &str =
    "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')";

/// Distributed mode: how Citus holds each of `$1` (queue), `$2` (dead-letter) and `$3`
/// (paused) tables → `(which, partmethod, distribution column, colocation group)`, NULLs
/// for a table Citus does not know (a local table); `which` is 0, 1, 2.
pub(crate) const CITUS_DISTRIBUTION: &str = r#"
SELECT t.which, p.partmethod::text,
       CASE WHEN p.partmethod = 'h' THEN column_to_column_name(p.logicalrelid, p.partkey) END,
       p.colocationid
FROM (VALUES (0, to_regclass($1)), (1, to_regclass($2)), (2, to_regclass($3))) AS t(which, oid)
LEFT JOIN pg_dist_partition p ON p.logicalrelid = t.oid
WHERE t.oid IS NOT NULL
ORDER BY t.which"#;

/// The definition of the named CHECK on `$1`, if any (`$2` its name).
pub(crate) const CHECK_DEF: &str = r#"
SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c
WHERE c.conrelid = to_regclass($1) AND c.conname = $2 AND c.contype = 'c'"#;
