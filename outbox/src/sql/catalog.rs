//! Catalog reads of `validate_schema` (SPEC §8). Static: they take the table as a bind
//! parameter, not as text.

/// `$1` qualified table name → its oid, or NULL when it does not exist.
pub(crate) const TABLE_OID: &str = "SELECT to_regclass($1)::oid::bigint";

/// `$1` table oid → `(column, format_type, NOT NULL)` of every live column.
pub(crate) const COLUMNS: &str = r#"
SELECT attname::text, format_type(atttypid, atttypmod), attnotnull
FROM pg_attribute
WHERE attrelid = $1::bigint::oid AND attnum > 0 AND NOT attisdropped"#;

/// `$1` qualified table name → `(key columns in order, unique, partial predicate)` of every
/// valid index.
pub(crate) const INDEXES: &str = r#"
SELECT array(SELECT a.attname::text
             FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
             ORDER BY k.ord),
       i.indisunique, pg_get_expr(i.indpred, i.indrelid)
FROM pg_index i
WHERE i.indrelid = to_regclass($1) AND i.indisvalid"#;

/// `$1` qualified table name → `(definition, validated)` of every CHECK constraint.
pub(crate) const CHECKS: &str = r#"
SELECT pg_get_constraintdef(oid), convalidated FROM pg_constraint
WHERE conrelid = to_regclass($1) AND contype = 'c'"#;
