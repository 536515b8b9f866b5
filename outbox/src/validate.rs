//! Schema validation (SPEC §8): compares the live database with what this version needs and
//! reports every problem at once. Extra columns and indexes are fine.

use std::collections::HashMap;

use sqlx::{PgPool, Row};

use crate::error::{Error, Result, SchemaProblem};
use crate::names::Names;
use crate::sql::catalog;

/// `(column, format_type output, NOT NULL, added by an upgrade of older deployments)`.
const QUEUE_COLUMNS: &[(&str, &str, bool, bool)] = &[
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
];

/// An index this version needs: key columns, uniqueness and partial predicate (as
/// `pg_get_expr` prints it, normalised).
struct WantedIndex<'a> {
    name: &'a str,
    columns: &'a [&'a str],
    unique: bool,
    predicate: Option<&'a str>,
}

/// Live index facts.
struct LiveIndex {
    columns: Vec<String>,
    unique: bool,
    predicate: Option<String>,
}

/// Strips what `pg_get_expr`/`pg_get_constraintdef` add or a user may vary: parentheses,
/// white space, letter case.
fn normalise(expr: &str) -> String {
    expr.chars()
        .filter(|c| !c.is_whitespace() && *c != '(' && *c != ')')
        .flat_map(char::to_lowercase)
        .collect()
}

/// Compares the live schema with what this version needs ([`crate::Outbox::validate_schema`]).
pub(crate) async fn validate(n: &Names, dead_letter: bool, pool: &PgPool) -> Result<()> {
    let mut problems = Vec::new();
    let table_exists =
        check_columns(pool, &n.qtable, &n.table_name, QUEUE_COLUMNS, &mut problems).await?;
    if table_exists {
        check_queue_indexes(pool, n, &mut problems).await?;
        check_queue_constraints(pool, n, &mut problems).await?;
    }
    if dead_letter {
        let dlq_exists =
            check_columns(pool, &n.qdlq, &n.dlq_name, DLQ_COLUMNS, &mut problems).await?;
        if dlq_exists {
            let live = live_indexes(pool, &n.qdlq).await?;
            check_index(
                &n.dlq_name,
                &WantedIndex {
                    name: &n.dlq_idx,
                    columns: &["queue", "failed_at"],
                    unique: false,
                    predicate: None,
                },
                &live,
                &mut problems,
            );
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Error::SchemaMismatch { problems })
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
    pool: &PgPool,
    qualified: &str,
    table: &str,
    wanted: &[(&str, &str, bool, bool)],
    problems: &mut Vec<SchemaProblem>,
) -> Result<bool> {
    let oid: Option<i64> = sqlx::query_scalar(catalog::TABLE_OID)
        .bind(qualified)
        .fetch_one(pool)
        .await?;
    let Some(oid) = oid else {
        problems.push(problem(
            table,
            "table is missing; run the migrations",
            false,
        ));
        return Ok(false);
    };
    let rows = sqlx::query(catalog::COLUMNS)
        .bind(oid)
        .fetch_all(pool)
        .await?;
    let mut live: HashMap<String, (String, bool)> = HashMap::new();
    for r in rows {
        live.insert(r.try_get(0)?, (r.try_get(1)?, r.try_get(2)?));
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
    Ok(true)
}

async fn live_indexes(pool: &PgPool, qualified: &str) -> Result<Vec<LiveIndex>> {
    let rows = sqlx::query(catalog::INDEXES)
        .bind(qualified)
        .fetch_all(pool)
        .await?;
    rows.iter()
        .map(|r| {
            Ok(LiveIndex {
                columns: r.try_get(0)?,
                unique: r.try_get(1)?,
                predicate: r.try_get(2)?,
            })
        })
        .collect()
}

/// Looks for an index with the wanted key columns and reports the closest miss.
fn check_index(
    table: &str,
    want: &WantedIndex<'_>,
    live: &[LiveIndex],
    problems: &mut Vec<SchemaProblem>,
) {
    let same_columns: Vec<&LiveIndex> = live
        .iter()
        .filter(|i| {
            i.columns
                .iter()
                .map(String::as_str)
                .eq(want.columns.iter().copied())
        })
        .collect();
    let want_pred = want.predicate.map(normalise);
    let fits = |i: &&LiveIndex| {
        i.predicate.as_deref().map(normalise) == want_pred && (i.unique || !want.unique)
    };
    if same_columns.iter().any(fits) {
        return;
    }
    let object = format!(
        "{table}: index {} on ({})",
        want.name,
        want.columns.join(", ")
    );
    let message = if let Some(i) = same_columns.first() {
        match (&i.predicate, want.predicate) {
            (None, Some(p)) => format!("index is not partial; it needs `WHERE {p}`"),
            (Some(live), Some(p)) if normalise(live) != normalise(p) => {
                format!("partial index has `WHERE {live}`, expected `WHERE {p}`")
            }
            (Some(live), None) => {
                format!("index is partial (`WHERE {live}`); it must cover every row")
            }
            _ => "index is not UNIQUE".to_owned(),
        }
    } else {
        "index is missing; run the migrations".to_owned()
    };
    problems.push(problem(object, message, false));
}

async fn check_queue_indexes(
    pool: &PgPool,
    n: &Names,
    problems: &mut Vec<SchemaProblem>,
) -> Result<()> {
    let live = live_indexes(pool, &n.qtable).await?;
    for want in [
        WantedIndex {
            name: &n.pending_idx,
            columns: &["queue", "next_attempt_at"],
            unique: false,
            predicate: Some("acquired_token IS NULL"),
        },
        WantedIndex {
            name: &n.lease_idx,
            columns: &["queue", "acquired_at"],
            unique: false,
            predicate: Some("acquired_token IS NOT NULL"),
        },
        WantedIndex {
            name: &n.timer_uq,
            columns: &["queue", "timer_id"],
            unique: true,
            predicate: Some("timer_id IS NOT NULL"),
        },
    ] {
        check_index(&n.table_name, &want, &live, problems);
    }
    Ok(())
}

async fn check_queue_constraints(
    pool: &PgPool,
    n: &Names,
    problems: &mut Vec<SchemaProblem>,
) -> Result<()> {
    let rows = sqlx::query(catalog::CHECKS)
        .bind(&n.qtable)
        .fetch_all(pool)
        .await?;
    let mut live = Vec::new();
    for r in rows {
        let def: String = r.try_get(0)?;
        let valid: bool = r.try_get(1)?;
        // pg_get_constraintdef appends " NOT VALID" to an unvalidated CHECK; convalidated
        // already says so.
        let def = def.trim_end().strip_suffix("NOT VALID").unwrap_or(&def);
        live.push((normalise(def), valid));
    }
    // Accepted spellings of each CHECK, normalised (either operand order).
    let lease = [
        normalise("CHECK ((acquired_token IS NULL) = (acquired_at IS NULL))"),
        normalise("CHECK ((acquired_at IS NULL) = (acquired_token IS NULL))"),
    ];
    let rearm = [
        normalise("CHECK (rearm_at IS NULL OR acquired_token IS NOT NULL)"),
        normalise("CHECK (acquired_token IS NOT NULL OR rearm_at IS NULL)"),
    ];
    let cancel = [
        normalise("CHECK (cancelled_at IS NULL OR acquired_token IS NOT NULL)"),
        normalise("CHECK (acquired_token IS NOT NULL OR cancelled_at IS NULL)"),
    ];
    for (name, forms, upgrade, def) in [
        (
            &n.lease_ck,
            &lease,
            false,
            "CHECK ((acquired_token IS NULL) = (acquired_at IS NULL))",
        ),
        (
            &n.rearm_ck,
            &rearm,
            true,
            "CHECK (rearm_at IS NULL OR acquired_token IS NOT NULL)",
        ),
        (
            &n.cancel_ck,
            &cancel,
            true,
            "CHECK (cancelled_at IS NULL OR acquired_token IS NOT NULL)",
        ),
    ] {
        let found: Vec<bool> = live
            .iter()
            .filter(|(d, _)| forms.contains(d))
            .map(|(_, v)| *v)
            .collect();
        let object = format!("{}: constraint {name}", n.table_name);
        if found.is_empty() {
            problems.push(problem(object, format!("`{def}` is missing"), upgrade));
        } else if !found.contains(&true) {
            problems.push(problem(
                object,
                format!("`{def}` is NOT VALID; run its VALIDATE CONSTRAINT step"),
                upgrade,
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::normalise;

    #[test]
    fn normalise_ignores_parens_space_case() {
        assert_eq!(
            normalise("CHECK (((acquired_token IS NULL) = (acquired_at IS NULL)))"),
            normalise("check ((acquired_token is null) = (acquired_at is null))")
        );
    }
}
