//! The helpers every statement family renders with: the one place rendered text becomes
//! an executable statement, and the wake-up notification expression. A leaf of `sql`.

use std::sync::Arc;

use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

use crate::names::Names;

/// The one place rendered text becomes an executable statement (sqlx 0.9 refuses a
/// `String` that was not asserted safe). Safe: the text holds only our own SQL and
/// identifiers quoted by [`crate::names`]; values are bound, never pasted. Kept as an
/// `Arc<str>`, so executing it clones a pointer, not the text.
pub(super) fn statement(text: &str) -> SqlStr {
    AssertSqlSafe(Arc::<str>::from(text)).into_sql_str()
}

/// A query rendered from a raw string that starts on its own line.
pub(super) fn query(text: String) -> SqlStr {
    statement(text.trim())
}

/// The NOTIFY payload, `<deadline as epoch milliseconds>:<queue>`, as an
/// expression over the row alias `row`. Never payload data. Without notifications
/// (`OutboxBuilder::notify(false)`) a NULL of the same type: the statements keep their
/// shape and their results, and their commits skip the notification queue's lock.
///
/// Distributed mode (Citus): the payload itself, not the call. Citus runs a statement that
/// touches one shard whole on the worker node that holds it, outer `SELECT` included, and a
/// `pg_notify` there reaches no session listening on the coordinator (measured: a CTE that
/// updates or deletes a distributed row notifies on the worker; only an `INSERT` CTE's outer
/// `SELECT` runs on the coordinator). So the caller reads the payloads the statement
/// returns and sends them through [`Wake::forward`] on the same connection, in the same
/// transaction.
pub(super) fn notify(n: &Names, row: &str) -> String {
    if !n.notify {
        return "NULL::text".to_owned();
    }
    let payload = format!(
        "floor(extract(epoch FROM {row}.next_attempt_at) * 1000)::bigint::text || ':' || {row}.queue"
    );
    match n.buckets {
        Some(_) => format!("({payload})"),
        None => format!(
            "pg_notify({channel}, {payload})::text",
            channel = crate::names::quote_literal(&n.channel)
        ),
    }
}

/// The statement that sends the wake-up payloads a distributed statement returned
/// ([`notify`]): `$1 text[]` payloads → nothing. `None` on a single node (each statement
/// notifies itself) and without notifications.
pub(crate) fn wake(n: &Names) -> Option<SqlStr> {
    (n.notify && n.buckets.is_some()).then(|| {
        statement(&format!(
            "SELECT count(pg_notify({channel}, p)) FROM unnest($1::text[]) AS p",
            channel = crate::names::quote_literal(&n.channel)
        ))
    })
}

/// Distributed mode: ` AND <alias>bucket = $<param>::smallint`, the predicate that routes a
/// statement to the one shard of a bucket (its value travels as the statement's last
/// parameter); empty for a single node, whose statements take no such parameter.
pub(super) fn in_bucket(n: &Names, alias: &str, param: u32) -> String {
    match n.buckets {
        Some(_) => format!(" AND {alias}bucket = ${param}::smallint"),
        None => String::new(),
    }
}
