//! The diagnosis of a pool that cannot connect ([`explain`]). Every place that takes a
//! connection from a pool (a claim, a publish or cancel on `&pool`, a handler's
//! transaction, `migrate()`, the LISTEN connection) hands its error here, so the user reads
//! the cause instead of "pool timed out".

use crate::error::Error;

/// Replaces "pool timed out" by the reason it did when that reason is the database being
/// unreachable: sqlx reports only the timeout, so connect once directly and keep its error
/// (connection refused, authentication failed, …). Anything else is returned as it was.
pub(crate) async fn explain(pool: &sqlx::PgPool, e: Error) -> Error {
    if !matches!(e, Error::Database(sqlx::Error::PoolTimedOut)) {
        return e;
    }
    let options = pool.connect_options();
    let direct = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        sqlx::ConnectOptions::connect(&*options),
    );
    match direct.await {
        Ok(Err(cause)) => Error::Database(cause),
        Ok(Ok(conn)) => {
            drop(conn);
            e
        }
        Err(_) => e,
    }
}
