//! Reading the server's statistics around a measured window.
//!
//! Every statement the harness itself sends carries [`TAG`] ([`tagged`]), and rows of
//! `pg_stat_statements` whose text holds it are left out, so the counts are the runtime's
//! (and the sqlx transaction control the benchmark's own publishes need: `BEGIN`/`COMMIT`).
//!
//! Table and WAL counters are kept per backend and flushed to shared memory at most once a
//! second, or when the backend exits. The harness therefore closes the connections that did
//! the work and waits until their backends are gone (exit flushes them) before reading, and
//! asks for an immediate flush of its own backend with `pg_stat_force_next_flush()`.

use sqlx::AssertSqlSafe;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use sqlx::postgres::PgConnection;
use sqlx::Row;

use crate::BoxError;

/// Marks the harness's own statements (see [`tagged`]).
pub const TAG: &str = "/* outbox-bench probe */";

/// `sql` (one statement) with [`TAG`] after it. After, not before: from PostgreSQL 18,
/// `pg_stat_statements` records a statement's text from its first token, so a comment in
/// front is dropped (and the harness's own polling would count as the runtime's); one at
/// the end stays, on every version.
pub fn tagged(sql: &str) -> String {
    format!("{} {TAG}", sql.trim_end().trim_end_matches(';'))
}

/// `application_name` of the connections whose work is measured.
pub const WORK_APP: &str = "outbox-bench-work";

/// WAL counters (`pg_stat_wal`) and the insert position.
#[derive(Debug, Clone, Default)]
pub struct Wal {
    pub records: i64,
    pub fpi: i64,
    pub bytes: i64,
    /// `pg_current_wal_insert_lsn()`, for `pg_waldump`.
    pub lsn: String,
}

/// Tuple counters of one table (`pg_stat_user_tables`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tuples {
    pub ins: i64,
    pub upd: i64,
    pub del: i64,
    pub hot_upd: i64,
    /// `n_dead_tup` at the end (not a difference).
    pub dead: i64,
}

/// One row of `pg_stat_statements`.
#[derive(Debug, Clone)]
pub struct Statement {
    pub query: String,
    pub calls: i64,
    pub rows: i64,
    pub total_ms: f64,
    pub wal_records: i64,
    pub wal_fpi: i64,
    pub wal_bytes: i64,
}

impl Statement {
    /// The statement's kind: its leading keyword, and for `WITH` the verb of the main
    /// statement after the CTEs (`WITH…UPDATE`), so a CTE-wrapped write is visible as one.
    pub fn keyword(&self) -> String {
        keyword(&self.query)
    }
}

pub async fn flush_own(conn: &mut PgConnection) -> Result<(), BoxError> {
    sqlx::query(AssertSqlSafe(tagged("SELECT pg_stat_force_next_flush()")))
        .execute(&mut *conn)
        .await?;
    // The flush happens when the transaction above ends; stats views read afterwards (in a
    // new transaction, so no cached snapshot) see it.
    Ok(())
}

pub async fn wal(conn: &mut PgConnection) -> Result<Wal, BoxError> {
    flush_own(conn).await?;
    let r = sqlx::query(AssertSqlSafe(tagged(
        "SELECT wal_records, wal_fpi, wal_bytes::bigint, \
           pg_current_wal_insert_lsn()::text FROM pg_stat_wal",
    )))
    .fetch_one(&mut *conn)
    .await?;
    Ok(Wal {
        records: r.try_get(0)?,
        fpi: r.try_get(1)?,
        bytes: r.try_get(2)?,
        lsn: r.try_get(3)?,
    })
}

pub async fn tuples(conn: &mut PgConnection, table: &str) -> Result<Tuples, BoxError> {
    flush_own(conn).await?;
    let r = sqlx::query(AssertSqlSafe(tagged(
        "SELECT n_tup_ins, n_tup_upd, n_tup_del, n_tup_hot_upd, n_dead_tup \
         FROM pg_stat_user_tables WHERE relid = to_regclass($1)",
    )))
    .bind(table)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(r) = r else {
        return Ok(Tuples::default());
    };
    Ok(Tuples {
        ins: r.try_get(0)?,
        upd: r.try_get(1)?,
        del: r.try_get(2)?,
        hot_upd: r.try_get(3)?,
        dead: r.try_get(4)?,
    })
}

pub async fn reset_statements(conn: &mut PgConnection) -> Result<(), BoxError> {
    sqlx::query(AssertSqlSafe(tagged("SELECT pg_stat_statements_reset()")))
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// Every statement of the current database since the last reset, without the harness's.
pub async fn statements(conn: &mut PgConnection) -> Result<Vec<Statement>, BoxError> {
    let rows = sqlx::query(AssertSqlSafe(tagged(
        "SELECT query, calls, rows, total_exec_time, wal_records, wal_fpi, wal_bytes::bigint \
         FROM pg_stat_statements \
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND query NOT LIKE '%outbox-bench probe%' \
         ORDER BY calls DESC, query",
    )))
    .fetch_all(&mut *conn)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(Statement {
                query: r.try_get(0)?,
                calls: r.try_get(1)?,
                rows: r.try_get(2)?,
                total_ms: r.try_get(3)?,
                wal_records: r.try_get(4)?,
                wal_fpi: r.try_get(5)?,
                wal_bytes: r.try_get(6)?,
            })
        })
        .collect()
}

/// Sum of calls of the statements above; used to see that a worker has gone quiet.
pub async fn total_calls(conn: &mut PgConnection) -> Result<i64, BoxError> {
    let n: Option<i64> = sqlx::query_scalar(AssertSqlSafe(tagged(
        "SELECT sum(calls)::bigint FROM pg_stat_statements \
         WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND query NOT LIKE '%outbox-bench probe%'",
    )))
    .fetch_one(&mut *conn)
    .await?;
    Ok(n.unwrap_or(0))
}

/// Calls per statement kind.
pub fn by_keyword(statements: &[Statement]) -> BTreeMap<String, i64> {
    let mut out = BTreeMap::new();
    for s in statements {
        *out.entry(s.keyword()).or_insert(0) += s.calls;
    }
    out
}

/// Waits until no backend other than ours matches `filter` (an SQL condition on
/// `pg_stat_activity`), so their statistics have been flushed by their exit.
///
/// `sqlx::Pool::close` can return while a connection released at the same moment sits
/// idle in the pool, still open (a race seen in sqlx 0.8's close loop, still guarded against). With `terminate_idle`
/// such a straggler is terminated after a grace period (a terminated backend flushes its
/// statistics on exit like any other); only ever pass it for the harness's own
/// connections (`application_name` `outbox-bench-…`), never for someone else's.
pub async fn wait_backends_gone(
    conn: &mut PgConnection,
    filter: &str,
    terminate_idle: bool,
) -> Result<(), BoxError> {
    let start = Instant::now();
    let deadline = start + Duration::from_secs(30);
    let mut terminated = false;
    loop {
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(tagged(&format!(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE pid <> pg_backend_pid() AND backend_type = 'client backend' AND ({filter})"
        ))))
        .fetch_one(&mut *conn)
        .await?;
        if n == 0 {
            return Ok(());
        }
        if terminate_idle && !terminated && start.elapsed() > Duration::from_millis(500) {
            sqlx::query(AssertSqlSafe(tagged(&format!(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE pid <> pg_backend_pid() AND backend_type = 'client backend' \
                   AND state = 'idle' AND ({filter})"
            ))))
            .execute(&mut *conn)
            .await?;
            terminated = true;
        }
        if Instant::now() > deadline {
            let who: Vec<String> = sqlx::query_scalar(AssertSqlSafe(tagged(&format!(
                "SELECT format('pid %s app %s state %s wait %s/%s query %s', pid, application_name, \
                   state, wait_event_type, wait_event, left(query, 80)) FROM pg_stat_activity \
                 WHERE pid <> pg_backend_pid() AND backend_type = 'client backend' AND ({filter})"
            ))))
            .fetch_all(&mut *conn)
            .await?;
            return Err(format!(
                "{n} backends ({filter}) still there after 30 s: {}",
                who.join("; ")
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// See [`Statement::keyword`].
pub fn keyword(query: &str) -> String {
    let tokens = tokens(query);
    let Some(first) = tokens.first() else {
        return "?".to_owned();
    };
    let first = first.0.to_ascii_uppercase();
    if first != "WITH" {
        return first;
    }
    // The main statement is the first data-modifying or SELECT verb at depth 0 after the
    // CTE list (CTE bodies sit inside parentheses).
    for (word, depth) in tokens.iter().skip(1) {
        if *depth != 0 {
            continue;
        }
        let w = word.to_ascii_uppercase();
        if matches!(
            w.as_str(),
            "SELECT" | "INSERT" | "UPDATE" | "DELETE" | "MERGE"
        ) {
            return format!("WITH…{w}");
        }
    }
    "WITH".to_owned()
}

/// Words of `query` with their parenthesis depth, skipping comments and quoted text.
fn tokens(query: &str) -> Vec<(String, i32)> {
    let b = query.as_bytes();
    let mut out = Vec::new();
    let mut depth = 0;
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'-' && b.get(i + 1) == Some(&b'-') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                i += 1;
            }
            i += 2;
        } else if c == b'\'' || c == b'"' {
            i += 1;
            while i < b.len() && b[i] != c {
                i += 1;
            }
            i += 1;
        } else if c == b'(' {
            depth += 1;
            i += 1;
        } else if c == b')' {
            depth -= 1;
            i += 1;
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push((query[start..i].to_owned(), depth));
        } else {
            i += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{keyword, tagged};

    #[test]
    fn the_tag_follows_the_statement() {
        assert_eq!(tagged("SELECT 1"), "SELECT 1 /* outbox-bench probe */");
        assert_eq!(
            tagged("CHECKPOINT;\n"),
            "CHECKPOINT /* outbox-bench probe */"
        );
    }

    #[test]
    fn keywords() {
        assert_eq!(keyword("DELETE FROM t WHERE id = $1"), "DELETE");
        assert_eq!(keyword("  begin"), "BEGIN");
        assert_eq!(keyword("/* x */ SELECT 1"), "SELECT");
        assert_eq!(
            keyword("WITH a AS (SELECT 1 FROM x), b AS (DELETE FROM y RETURNING 1) UPDATE t SET x = '(' FROM a"),
            "WITH…UPDATE"
        );
        assert_eq!(
            keyword("WITH ins AS (INSERT INTO t VALUES (1) RETURNING id) SELECT ins.id FROM ins"),
            "WITH…SELECT"
        );
        assert_eq!(keyword("LISTEN \"x\""), "LISTEN");
    }
}
