//! The shape of the tables this version needs: the default table name, the width of the
//! name columns, the indexes and CHECK constraints, and the one rule that matches indexes
//! and CHECKs against the catalog: **by definition, not by name** (key columns, uniqueness
//! and partial predicate of an index; the expression of a CHECK), so a renamed index or
//! constraint still counts. `validate_schema` reports against it, and `migrate()` skips a
//! step whose pieces it finds, so the two never disagree about what is there.

use sqlx::Row;

use crate::error::{OutboxSql, Result};
use crate::names::Names;
use crate::scope::Scope;
use crate::sql::catalog;

/// The default queue table name. Its dead-letter table is `outbox_dlq`, and both live in the
/// connection's `search_path` unless a schema is configured.
pub const DEFAULT_TABLE: &str = "outbox";

/// Longest queue name and timer id, in bytes (the columns are `varchar(255)`).
pub const MAX_NAME_BYTES: usize = 255;

/// An index this version needs.
#[derive(Debug)]
pub(crate) struct WantedIndex {
    /// The name the migrations give it.
    pub name: String,
    pub columns: &'static [&'static str],
    pub unique: bool,
    /// The partial predicate, as written in the migrations.
    pub predicate: Option<&'static str>,
    /// Added by an upgrade of older deployments (its absence `needs_upgrade`).
    pub upgrade: bool,
}

/// An index as the catalog shows it.
#[derive(Debug)]
pub(crate) struct LiveIndex {
    pub columns: Vec<String>,
    pub unique: bool,
    pub predicate: Option<String>,
    /// False while a `CREATE INDEX CONCURRENTLY` builds it, and for good when that build
    /// was interrupted.
    pub valid: bool,
    pub name: String,
}

/// A CHECK constraint this version needs.
#[derive(Debug)]
pub(crate) struct WantedCheck {
    /// The name the migrations give it.
    pub name: String,
    /// Its definition as `pg_get_constraintdef` prints it.
    pub def: &'static str,
    /// Accepted spellings, normalised (either operand order).
    forms: [String; 2],
    /// Added by an upgrade of older deployments.
    pub upgrade: bool,
}

/// A CHECK constraint as the catalog shows it.
#[derive(Debug)]
pub(crate) struct LiveCheck {
    /// Normalised definition, without the ` NOT VALID` that `pg_get_constraintdef` appends
    /// to an unvalidated one.
    def: String,
    pub validated: bool,
}

/// Strips what `pg_get_expr`/`pg_get_constraintdef` add or a user may vary: parentheses,
/// white space, letter case.
pub(crate) fn normalise(expr: &str) -> String {
    expr.chars()
        .filter(|c| !c.is_whitespace() && *c != '(' && *c != ')')
        .flat_map(char::to_lowercase)
        .collect()
}

/// The queue table's indexes.
pub(crate) fn queue_indexes(n: &Names) -> Vec<WantedIndex> {
    let index = |name: &String, columns, unique, predicate| WantedIndex {
        name: name.clone(),
        columns,
        unique,
        predicate,
        upgrade: false,
    };
    // Distributed mode: the distribution column leads every index (a unique one must hold
    // it, and each statement names one bucket).
    let d = n.buckets.is_some();
    vec![
        index(
            &n.pending_idx,
            if d {
                &["bucket", "queue", "next_attempt_at"]
            } else {
                &["queue", "next_attempt_at"]
            },
            false,
            Some("acquired_token IS NULL"),
        ),
        index(
            &n.lease_idx,
            if d {
                &["bucket", "queue", "acquired_at"]
            } else {
                &["queue", "acquired_at"]
            },
            false,
            Some("acquired_token IS NOT NULL"),
        ),
        index(
            &n.timer_uq,
            if d {
                &["bucket", "queue", "timer_id"]
            } else {
                &["queue", "timer_id"]
            },
            true,
            Some("timer_id IS NOT NULL"),
        ),
    ]
}

/// The dead-letter table's indexes.
pub(crate) fn dlq_indexes(n: &Names) -> Vec<WantedIndex> {
    vec![
        WantedIndex {
            name: n.dlq_idx.clone(),
            columns: if n.buckets.is_some() {
                &["bucket", "queue", "failed_at"]
            } else {
                &["queue", "failed_at"]
            },
            unique: false,
            predicate: None,
            upgrade: false,
        },
        WantedIndex {
            name: n.dlq_failed_idx.clone(),
            columns: if n.buckets.is_some() {
                &["bucket", "failed_at"]
            } else {
                &["failed_at"]
            },
            unique: false,
            predicate: None,
            upgrade: true,
        },
    ]
}

/// The queue table's CHECK constraints.
pub(crate) fn queue_checks(n: &Names) -> Vec<WantedCheck> {
    let check = |name: &String, def: &'static str, swapped: &str, upgrade| WantedCheck {
        name: name.clone(),
        def,
        forms: [normalise(def), normalise(swapped)],
        upgrade,
    };
    vec![
        check(
            &n.lease_ck,
            "CHECK ((acquired_token IS NULL) = (acquired_at IS NULL))",
            "CHECK ((acquired_at IS NULL) = (acquired_token IS NULL))",
            false,
        ),
        check(
            &n.rearm_ck,
            "CHECK (rearm_at IS NULL OR acquired_token IS NOT NULL)",
            "CHECK (acquired_token IS NOT NULL OR rearm_at IS NULL)",
            true,
        ),
        check(
            &n.cancel_ck,
            "CHECK (cancelled_at IS NULL OR acquired_token IS NOT NULL)",
            "CHECK (acquired_token IS NOT NULL OR cancelled_at IS NULL)",
            true,
        ),
    ]
}

impl WantedIndex {
    /// The valid live indexes on the same key columns, in catalog order.
    pub(crate) fn same_columns<'a>(&self, live: &'a [LiveIndex]) -> Vec<&'a LiveIndex> {
        live.iter()
            .filter(|i| {
                i.valid
                    && i.columns
                        .iter()
                        .map(String::as_str)
                        .eq(self.columns.iter().copied())
            })
            .collect()
    }

    /// Whether a valid live index does this one's job: same key columns and predicate, and
    /// unique if this one must be (a unique index serves a non-unique need too).
    pub(crate) fn present_in(&self, live: &[LiveIndex]) -> bool {
        let predicate = self.predicate.map(normalise);
        self.same_columns(live).iter().any(|i| {
            i.predicate.as_deref().map(normalise) == predicate && (i.unique || !self.unique)
        })
    }

    /// Whether an INVALID index of this name is left on the table.
    pub(crate) fn invalid_in(&self, live: &[LiveIndex]) -> bool {
        live.iter().any(|i| !i.valid && i.name == self.name)
    }
}

impl WantedCheck {
    /// `None` if no live CHECK has this definition; otherwise whether one is validated.
    pub(crate) fn state(&self, live: &[LiveCheck]) -> Option<bool> {
        let found: Vec<bool> = live
            .iter()
            .filter(|c| self.forms.contains(&c.def))
            .map(|c| c.validated)
            .collect();
        (!found.is_empty()).then(|| found.contains(&true))
    }
}

/// Every index of the table named `qualified` (none if it does not exist).
pub(crate) async fn live_indexes(
    db: impl sqlx::PgExecutor<'_>,
    scope: Scope,
    qualified: &str,
) -> Result<Vec<LiveIndex>> {
    let rows = scope
        .query(catalog::INDEXES)
        .bind(qualified)
        .fetch_all(db)
        .await
        .outbox_sql()?;
    rows.iter()
        .map(|r| {
            Ok(LiveIndex {
                columns: r.try_get(0).outbox_sql()?,
                unique: r.try_get(1).outbox_sql()?,
                predicate: r.try_get(2).outbox_sql()?,
                valid: r.try_get(3).outbox_sql()?,
                name: r.try_get(4).outbox_sql()?,
            })
        })
        .collect()
}

/// Every CHECK constraint of the table named `qualified` (none if it does not exist).
pub(crate) async fn live_checks(
    db: impl sqlx::PgExecutor<'_>,
    scope: Scope,
    qualified: &str,
) -> Result<Vec<LiveCheck>> {
    let rows = scope
        .query(catalog::CHECKS)
        .bind(qualified)
        .fetch_all(db)
        .await
        .outbox_sql()?;
    rows.iter()
        .map(|r| {
            let def: String = r.try_get(0).outbox_sql()?;
            let def = def.trim_end();
            let def = def.strip_suffix("NOT VALID").unwrap_or(def);
            Ok(LiveCheck {
                def: normalise(def),
                validated: r.try_get(1).outbox_sql()?,
            })
        })
        .collect()
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
