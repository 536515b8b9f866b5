//! Schema validation: compares the live database with what this version needs and reports
//! every problem at once. Extra columns and indexes are fine.

use std::collections::HashMap;

use sqlx::{PgConnection, PgPool, Row};

use super::problem::SchemaProblem;
use super::shape::{self, LiveIndex, WantedIndex};
use crate::error::{Error, OutboxSql, Result};
use crate::names::Names;
use crate::scope::{Db, Scope};
use crate::sql::catalog;

/// `(column, format_type output, NOT NULL, added by an upgrade of older deployments)`.
pub(super) const QUEUE_COLUMNS: &[(&str, &str, bool, bool)] = &[
    ("id", "bigint", true, false),
    ("queue", "character varying(255)", true, false),
    ("payload", "bytea", true, false),
    ("headers", "jsonb", false, false),
    ("attempts_count", "integer", true, false),
    ("deliveries_count", "integer", true, false),
    ("created_at", "timestamp with time zone", true, false),
    ("next_attempt_at", "timestamp with time zone", true, false),
    ("first_attempt_at", "timestamp with time zone", false, false),
    ("last_attempt_at", "timestamp with time zone", false, false),
    ("acquired_at", "timestamp with time zone", false, false),
    ("acquired_token", "uuid", false, false),
    ("timer_id", "character varying(255)", false, false),
    ("rearm_at", "timestamp with time zone", false, true),
    ("rearm_payload", "bytea", false, true),
    ("rearm_headers", "jsonb", false, true),
    ("cancelled_at", "timestamp with time zone", false, true),
];

const DLQ_COLUMNS: &[(&str, &str, bool, bool)] = &[
    ("id", "bigint", true, false),
    ("original_id", "bigint", true, false),
    ("queue", "character varying(255)", true, false),
    ("payload", "bytea", true, false),
    ("headers", "jsonb", false, false),
    ("timer_id", "character varying(255)", false, false),
    ("attempts_count", "integer", true, false),
    ("deliveries_count", "integer", true, false),
    ("created_at", "timestamp with time zone", true, false),
    ("failed_at", "timestamp with time zone", true, false),
    ("failure_reason", "character varying(64)", true, false),
    ("last_error", "text", false, false),
    ("redriven_at", "timestamp with time zone", false, true),
    ("redriven_id", "bigint", false, true),
];

/// Compares the live schema with what this version needs ([`crate::Outbox::validate_schema`]).
/// The table of paused queues: added by an upgrade step, so a missing table or column needs
/// the upgrade.
const PAUSED_COLUMNS: &[(&str, &str, bool, bool)] = &[
    ("queue", "character varying(255)", true, true),
    ("paused_at", "timestamp with time zone", true, true),
];

pub(crate) async fn validate(
    n: &Names,
    dead_letter: bool,
    scope: Scope,
    pool: &PgPool,
) -> Result<()> {
    // One connection and one transaction for every catalog read.
    let mut db = Db::begin(pool).await?;
    super::server::require_on(scope, &mut db, super::server::SUPPORTED_POSTGRES).await?;
    // An explicit schema never created is what `migrate` reports (SchemaNotFound, from
    // 3F000); the catalog reads below would only see every table missing.
    if let Some(qschema) = &n.qschema {
        let exists: bool = scope
            .query_scalar(catalog::SCHEMA_EXISTS)
            .bind(qschema)
            .fetch_one(&mut *db)
            .await
            .outbox_sql()?;
        if !exists {
            return Err(Error::SchemaNotFound {
                detail: format!("schema {qschema} does not exist"),
            });
        }
    }
    let problems = problems(n, dead_letter, scope, &mut db).await?;
    db.done().await?;
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Error::SchemaMismatch { problems })
    }
}

/// Every problem of the live schema, read on `db`.
async fn problems(
    n: &Names,
    dead_letter: bool,
    scope: Scope,
    db: &mut PgConnection,
) -> Result<Vec<SchemaProblem>> {
    let mut problems = Vec::new();
    let queue_columns = check_columns(
        &mut *db,
        scope,
        &n.qtable,
        &n.table_name,
        QUEUE_COLUMNS,
        false,
        &mut problems,
    )
    .await?;
    if let Some(columns) = queue_columns {
        // A table that lacks a column of the base shape is not an outbox queue table (one of
        // the application's, say): `migrate` refuses it, so its problems are that alone, not
        // a list of what `migrate` would add.
        let foreign = foreign_columns(n, |c| columns.iter().any(|live| live == c));
        if !foreign.is_empty() {
            return Ok(foreign);
        }
        let has_bucket = columns.iter().any(|c| c == "bucket");
        if let (Some(buckets), false) = (n.buckets, has_bucket) {
            // The mirror of the case below: a distributed outbox over a single-node table.
            // That alone is said: the rest (the distributed indexes) would only follow from
            // it, and `migrate` refuses to convert the table in place (a fresh-user trial
            // was told to run it).
            return Ok(vec![problem(
                &n.table_name,
                format!(
                    "is a single-node outbox table (no `bucket` column): build the outbox \
                     without `distributed({})`, as the table was migrated (moving to Citus \
                     takes a distributed table of its own: the Citus guide's \"Moving a \
                     single-node outbox to Citus\")",
                    buckets.count()
                ),
                false,
            )]);
        }
        if let Some(buckets) = n.buckets {
            check_distribution(&mut *db, scope, n, buckets.count(), &mut problems).await?;
        } else if has_bucket {
            // §13 (v3): a single-node outbox over the distributed layout. Every statement
            // would fail on the key (or on Citus's rules) with a raw error; say what to build.
            problems.push(problem(
                &n.table_name,
                "is a distributed (Citus) outbox table (it has a `bucket` column): build the \
                 outbox with `distributed(buckets)`, the table's bucket count",
                false,
            ));
        }
        check_queue_indexes(&mut *db, scope, n, &mut problems).await?;
        check_queue_constraints(&mut *db, scope, n, &mut problems).await?;
        // The claim reads the paused queues inside its statement: without the table every
        // claim fails.
        check_columns(
            &mut *db,
            scope,
            &n.qpaused,
            &n.paused_name,
            PAUSED_COLUMNS,
            true,
            &mut problems,
        )
        .await?;
    }
    if dead_letter {
        let before = problems.len();
        let dlq_exists = check_columns(
            &mut *db,
            scope,
            &n.qdlq,
            &n.dlq_name,
            DLQ_COLUMNS,
            false,
            &mut problems,
        )
        .await?;
        if let Some(columns) = &dlq_exists {
            // As for the queue table: a table without every base column is refused by
            // `migrate`, so its problems are that alone (the queue table's stay).
            let foreign = foreign_dlq_columns(n, |c| columns.iter().any(|live| live == c));
            if !foreign.is_empty() {
                problems.truncate(before);
                problems.extend(foreign);
                return Ok(problems);
            }
        }
        if dlq_exists.is_some() {
            let live = shape::live_indexes(&mut *db, scope, &n.qdlq).await?;
            for want in shape::dlq_indexes(n) {
                check_index(&n.dlq_name, &want, &live, &mut problems);
            }
        }
    }
    Ok(problems)
}

/// The problems of a queue table that lacks a column of the base shape (not one an upgrade
/// adds): it is not an outbox queue table, and `migrate` never alters a table it did not
/// create. Empty when every base column is there.
pub(super) fn foreign_columns(n: &Names, has: impl Fn(&str) -> bool) -> Vec<SchemaProblem> {
    foreign(
        QUEUE_COLUMNS,
        &n.table_name,
        "queue table",
        "`OutboxBuilder::table`, `--table`",
        has,
    )
}

/// As [`foreign_columns`], for the dead-letter table (which the base step creates and
/// indexes, with the dead-letter queue on or off).
pub(super) fn foreign_dlq_columns(n: &Names, has: impl Fn(&str) -> bool) -> Vec<SchemaProblem> {
    foreign(
        DLQ_COLUMNS,
        &n.dlq_name,
        "dead-letter table",
        "`OutboxBuilder::dead_letter_table`, `--dead-letter-table`",
        has,
    )
}

fn foreign(
    columns: &[(&str, &str, bool, bool)],
    table: &str,
    what: &str,
    option: &str,
    has: impl Fn(&str) -> bool,
) -> Vec<SchemaProblem> {
    columns
        .iter()
        .filter(|(column, _, _, by_upgrade)| !by_upgrade && !has(column))
        .map(|(column, ..)| SchemaProblem {
            object: format!("{table}.{column}"),
            message: format!(
                "column is missing: this table is not an outbox {what}, and migrate never \
                 alters a table it did not create; name another table ({option})"
            ),
            needs_upgrade: false,
        })
        .collect()
}

/// One table as Citus holds it: `(which: 0 queue, 1 dead-letter, 2 paused, partmethod,
/// distribution column, co-location group)`, NULLs for a local table.
type Distribution = (i32, Option<String>, Option<String>, Option<i32>);

/// Distributed mode: the tables as Citus holds them (hash-distributed by `bucket`,
/// co-located, the paused table a reference table) and the bucket count of the table's
/// CHECK against this outbox's.
async fn check_distribution(
    db: &mut PgConnection,
    scope: Scope,
    n: &Names,
    buckets: u16,
    problems: &mut Vec<SchemaProblem>,
) -> Result<()> {
    let citus: bool = scope
        .query_scalar(catalog::CITUS_INSTALLED)
        .fetch_one(&mut *db)
        .await
        .outbox_sql()?;
    if !citus {
        problems.push(problem(
            &n.table_name,
            "distributed mode needs the Citus extension in this database (CREATE EXTENSION citus, on a coordinator)",
            false,
        ));
        return Ok(());
    }
    let rows: Vec<Distribution> = scope
        .query_as(catalog::CITUS_DISTRIBUTION)
        .bind(&n.qtable)
        .bind(&n.qdlq)
        .bind(&n.qpaused)
        .fetch_all(&mut *db)
        .await
        .outbox_sql()?;
    let group = |which| rows.iter().find(|r| r.0 == which).and_then(|r| r.3);
    for (which, method, column, _) in &rows {
        let name = match which {
            0 => &n.table_name,
            1 => &n.dlq_name,
            _ => &n.paused_name,
        };
        let wanted = if *which == 2 {
            "a reference table (create_reference_table)"
        } else {
            "hash-distributed by bucket (create_distributed_table(..., 'bucket'))"
        };
        let ok = match which {
            2 => method.as_deref() == Some("n"),
            _ => method.as_deref() == Some("h") && column.as_deref() == Some("bucket"),
        };
        if !ok {
            let is = match (method.as_deref(), column.as_deref()) {
                (None, _) => "a local table of the coordinator".to_owned(),
                (Some("n"), _) => "a reference table".to_owned(),
                (Some("h"), Some(c)) => format!("hash-distributed by {c}"),
                (Some(m), _) => format!("distributed with method '{m}'"),
            };
            problems.push(problem(
                name,
                format!("is {is}; distributed mode needs {wanted}"),
                false,
            ));
        }
    }
    if let (Some(q), Some(d)) = (group(0), group(1)) {
        if q != d && rows.iter().any(|r| r.0 == 1 && r.1.as_deref() == Some("h")) {
            problems.push(problem(
                &n.dlq_name,
                format!("is in co-location group {d}, the queue table in {q}: the dead-letter archive would span nodes (create_distributed_table(..., colocate_with => the queue table))"),
                false,
            ));
        }
    }
    match held_buckets(db, scope, n).await? {
        Some(h) if h == buckets => {}
        Some(h) => problems.push(problem(
            &n.bucket_ck,
            format!("the table holds {h} buckets; this outbox is built with distributed({buckets}): every process must use the table's count (a keyed timer's bucket depends on it)"),
            false,
        )),
        None => problems.push(problem(
            &n.bucket_ck,
            format!("missing: the CHECK that records the bucket count (bucket >= 0 AND bucket < {buckets})"),
            false,
        )),
    }
    Ok(())
}

/// Distributed mode: the bucket count the table's CHECK records (`bucket < N`), if it has
/// that CHECK.
async fn held_buckets(db: &mut PgConnection, scope: Scope, n: &Names) -> Result<Option<u16>> {
    let def: Option<String> = scope
        .query_scalar(catalog::CHECK_DEF)
        .bind(&n.qtable)
        .bind(&n.bucket_ck)
        .fetch_optional(&mut *db)
        .await
        .outbox_sql()?;
    Ok(def.as_deref().and_then(|d| {
        let rest = d.split("bucket < ").nth(1)?;
        rest.trim_start_matches(['(', ' '])
            .split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse::<u16>()
            .ok()
    }))
}

/// Distributed mode: refuses an outbox whose bucket count is not the table's. A row id
/// names its bucket only with the table's count, so an action by id (`run_now`,
/// `reschedule`, `delete_pending`) of a process built with another count looks in the wrong
/// bucket and finds nothing; it calls this before saying so.
pub(crate) async fn require_table_buckets(
    db: &mut PgConnection,
    scope: Scope,
    n: &Names,
) -> Result<()> {
    let Some(buckets) = n.buckets.map(|b| b.count()) else {
        return Ok(());
    };
    match held_buckets(db, scope, n).await? {
        Some(held) if held != buckets => Err(Error::InvalidConfig {
            knob: "distributed",
            reason: format!(
                "the table {} holds {held} buckets; this outbox is built with distributed({buckets}), so a row id names another bucket: build every process with distributed({held})",
                n.qtable
            ),
        }),
        _ => Ok(()),
    }
}

fn problem(
    object: impl Into<String>,
    message: impl Into<String>,
    needs_upgrade: bool,
) -> SchemaProblem {
    SchemaProblem {
        object: object.into(),
        message: message.into(),
        needs_upgrade,
    }
}

/// Returns whether the table exists.
async fn check_columns(
    db: &mut PgConnection,
    scope: Scope,
    qualified: &str,
    table: &str,
    wanted: &[(&str, &str, bool, bool)],
    added_by_upgrade: bool,
    problems: &mut Vec<SchemaProblem>,
) -> Result<Option<Vec<String>>> {
    let oid: Option<i64> = scope
        .query_scalar(catalog::TABLE_OID)
        .bind(qualified)
        .fetch_one(&mut *db)
        .await
        .outbox_sql()?;
    let Some(oid) = oid else {
        // A table an upgrade adds gets the upgrade's hint from `SchemaProblem`'s display.
        let message = if added_by_upgrade {
            "table is missing"
        } else {
            "table is missing; run the migrations"
        };
        problems.push(problem(table, message, added_by_upgrade));
        return Ok(None);
    };
    let rows = scope
        .query(catalog::COLUMNS)
        .bind(oid)
        .fetch_all(&mut *db)
        .await
        .outbox_sql()?;
    let mut live: HashMap<String, (String, bool)> = HashMap::new();
    for r in rows {
        live.insert(
            r.try_get(0).outbox_sql()?,
            (r.try_get(1).outbox_sql()?, r.try_get(2).outbox_sql()?),
        );
    }
    for &(col, ty, not_null, rearm) in wanted {
        let object = format!("{table}.{col}");
        match live.get(col) {
            None => problems.push(problem(object, "column is missing", rearm)),
            Some((live_ty, live_nn)) => {
                if live_ty != ty {
                    problems.push(problem(
                        &object,
                        format!("type is `{live_ty}`, expected `{ty}`"),
                        false,
                    ));
                }
                if *live_nn != not_null {
                    let want = if not_null { "NOT NULL" } else { "nullable" };
                    problems.push(problem(&object, format!("must be {want}"), false));
                }
            }
        }
    }
    Ok(Some(live.into_keys().collect()))
}

/// Looks for a valid index with the wanted key columns and reports the closest miss. An
/// INVALID index of the wanted name (an interrupted `CREATE INDEX CONCURRENTLY`: Postgres
/// keeps it and updates it on every write, but never reads it) is reported as such, not as
/// missing.
fn check_index(
    table: &str,
    want: &WantedIndex,
    live: &[LiveIndex],
    problems: &mut Vec<SchemaProblem>,
) {
    if want.present_in(live) {
        return;
    }
    let object = format!(
        "{table}: index {} on ({})",
        want.name,
        want.columns.join(", ")
    );
    let same_columns = want.same_columns(live);
    let (message, upgrade) = if let Some(i) = same_columns.first() {
        let message = match (&i.predicate, want.predicate) {
            (None, Some(p)) => format!("index is not partial; it needs `WHERE {p}`"),
            (Some(live), Some(p)) if shape::normalise(live) != shape::normalise(p) => {
                format!("partial index has `WHERE {live}`, expected `WHERE {p}`")
            }
            (Some(live), None) => {
                format!("index is partial (`WHERE {live}`); it must cover every row")
            }
            _ => "index is not UNIQUE".to_owned(),
        };
        (message, false)
    } else if want.invalid_in(live) {
        let message = "index is INVALID (an interrupted CREATE INDEX CONCURRENTLY left it); \
                       `migrate()` drops and builds it again"
            .to_owned();
        (message, want.upgrade)
    } else if want.upgrade {
        ("index is missing".to_owned(), true)
    } else {
        ("index is missing; run the migrations".to_owned(), false)
    };
    problems.push(problem(object, message, upgrade));
}

async fn check_queue_indexes(
    db: &mut PgConnection,
    scope: Scope,
    n: &Names,
    problems: &mut Vec<SchemaProblem>,
) -> Result<()> {
    let live = shape::live_indexes(&mut *db, scope, &n.qtable).await?;
    for want in shape::queue_indexes(n) {
        check_index(&n.table_name, &want, &live, problems);
    }
    Ok(())
}

async fn check_queue_constraints(
    db: &mut PgConnection,
    scope: Scope,
    n: &Names,
    problems: &mut Vec<SchemaProblem>,
) -> Result<()> {
    let live = shape::live_checks(&mut *db, scope, &n.qtable).await?;
    for want in shape::queue_checks(n) {
        let object = format!("{}: constraint {}", n.table_name, want.name);
        let def = want.def;
        match want.state(&live) {
            None => problems.push(problem(object, format!("`{def}` is missing"), want.upgrade)),
            Some(false) => problems.push(problem(
                object,
                format!("`{def}` is NOT VALID; run its VALIDATE CONSTRAINT step"),
                want.upgrade,
            )),
            Some(true) => {}
        }
    }
    Ok(())
}
