//! Reading live rows without leasing them ([`Outbox::pending`](crate::Outbox::pending)): a
//! plain `SELECT` that takes no row lock, so a read never delays a claim or a completion.
//! Executes `sql::read`; the rows are decoded by `store::rows`.

use sqlx::PgConnection;

use crate::error::{OutboxSql, Result};
use crate::message::validate_queue;
use crate::scope::Scope;
use crate::sql;
use crate::store::rows::{stored_from_row, StoredRow};

/// Live rows of `queue` on `conn` ([`crate::Outbox::pending`]).
pub(crate) async fn pending(
    sql: &sql::read::Read,
    scope: Scope,
    conn: &mut PgConnection,
    queue: &str,
    limit: usize,
) -> Result<Vec<StoredRow>> {
    validate_queue(queue)?;
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut db = scope.on(conn).await?;
    let rows = scope
        .query(sql.pending.clone())
        .bind(queue)
        .bind(limit)
        .fetch_all(&mut *db)
        .await
        .outbox_sql()?;
    db.done().await?;
    rows.iter().map(stored_from_row).collect()
}
