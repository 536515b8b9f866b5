//! Where the library's statements run: on a server session of their own (a direct
//! connection, a session-mode pooler), or through a transaction-mode pooler, which hands
//! each transaction to whichever server connection is free
//! ([`OutboxBuilder::transaction_pooler`](crate::OutboxBuilder::transaction_pooler)).
//! Every executor of the crate takes a [`Scope`] and builds its queries and picks its
//! connection through it, so the rule is written once, here:
//!
//! - in a [`Scope::Transaction`] every statement is **unnamed** (`persistent(false)`):
//!   sqlx would otherwise prepare it under a name cached per client connection, which
//!   PgBouncer 1.18 does not carry to the next server connection;
//! - and it runs **inside a transaction**: an unnamed statement outside one is parsed and
//!   bound in two round trips, and the pooler may release the server connection between
//!   them, so its Bind would meet another client's statement;
//! - and what a session would keep becomes transaction-local: the completions'
//!   `lock_timeout` is `SET LOCAL` in the transaction, not a startup parameter (which
//!   PgBouncer refuses, or drops when told to ignore it).
//!
//! Anything that needs the session itself (advisory session locks, `LISTEN`, `CREATE INDEX
//! CONCURRENTLY`) is refused in a transaction scope with [`Error::SessionRequired`] or, for
//! a worker's `LISTEN`, when the worker is built.

// SPEC §13 (poolers): nothing the library does in one transaction depends on session state.
use std::ops::{Deref, DerefMut};
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::{Query, QueryAs, QueryScalar};
use sqlx::{
    Connection, FromRow, PgConnection, PgPool, Postgres, Row, SqlSafeStr, SqlStr, Transaction,
};

use crate::error::{Error, OutboxSql, Result};

/// How the crate's statements reach the server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Scope {
    /// A session of their own: statements prepared once per connection and cached (sqlx's
    /// default), session settings as startup parameters.
    #[default]
    Session,
    /// Through a transaction-mode pooler: nothing outlives its transaction.
    Transaction,
    /// A session of their own, every statement **unnamed**: a distributed outbox (Citus).
    /// Citus routes a statement to one shard by the value of its bucket parameter when it
    /// plans with the value; a cached generic plan of a join with `unnest` (the batched
    /// completions, the claim) is routed to every shard instead, so these statements are
    /// planned at each execution.
    Unnamed,
}

impl Scope {
    pub(crate) fn new(transaction_pooler: bool, distributed: bool) -> Scope {
        if transaction_pooler {
            Scope::Transaction
        } else if distributed {
            Scope::Unnamed
        } else {
            Scope::Session
        }
    }

    /// Whether sqlx may prepare the statement under a name and cache it.
    pub(crate) fn persistent(self) -> bool {
        self == Scope::Session
    }

    /// `sqlx::query`, named and cached only on a session.
    pub(crate) fn query<'q>(self, sql: impl SqlSafeStr) -> Query<'q, Postgres, PgArguments> {
        sqlx::query(sql).persistent(self.persistent())
    }

    /// `sqlx::query_scalar`, named and cached only on a session.
    pub(crate) fn query_scalar<'q, O>(
        self,
        sql: impl SqlSafeStr,
    ) -> QueryScalar<'q, Postgres, O, PgArguments>
    where
        (O,): for<'r> FromRow<'r, PgRow>,
    {
        sqlx::query_scalar(sql).persistent(self.persistent())
    }

    /// `sqlx::query_as`, named and cached only on a session.
    pub(crate) fn query_as<'q, O>(
        self,
        sql: impl SqlSafeStr,
    ) -> QueryAs<'q, Postgres, O, PgArguments>
    where
        O: for<'r> FromRow<'r, PgRow>,
    {
        sqlx::query_as(sql).persistent(self.persistent())
    }

    /// A connection of `pool` for statements that commit on their own: the pooled
    /// connection itself on a session (each statement its own transaction, as before), a
    /// transaction through a pooler. Finish it with [`Db::done`].
    pub(crate) async fn acquire(self, pool: &PgPool) -> Result<Db<'static>> {
        Ok(match self {
            Scope::Session | Scope::Unnamed => Db::Pooled(pool.acquire().await.outbox_sql()?),
            Scope::Transaction => Db::Tx(pool.begin().await.outbox_sql()?),
        })
    }

    /// [`Scope::acquire`] for the writes that must not wait long for a row lock: through a
    /// pooler the transaction starts with `SET LOCAL lock_timeout` (one round trip with its
    /// `BEGIN`); on a session the pool's connections carry it already (a startup parameter).
    pub(crate) async fn acquire_fenced(
        self,
        pool: &PgPool,
        lock_timeout: Duration,
    ) -> Result<Db<'static>> {
        Ok(match self {
            Scope::Session | Scope::Unnamed => Db::Pooled(pool.acquire().await.outbox_sql()?),
            Scope::Transaction => {
                let begin = format!(
                    "BEGIN; SET LOCAL lock_timeout = {}",
                    lock_timeout.as_millis()
                );
                Db::Tx(
                    pool.begin_with(sqlx::AssertSqlSafe(begin))
                        .await
                        .outbox_sql()?,
                )
            }
        })
    }

    /// The caller's connection, as it is, unless this is a pooler's scope and the
    /// connection is not in a transaction (one begun with sqlx's `begin`): then a
    /// transaction of its own on it, which [`Db::done`] commits.
    pub(crate) async fn on(self, conn: &mut PgConnection) -> Result<Db<'_>> {
        Ok(match self {
            Scope::Transaction if !conn.is_in_transaction() => {
                Db::Tx(conn.begin().await.outbox_sql()?)
            }
            _ => Db::Borrowed(conn),
        })
    }

    /// `e`, unless it is the missing paused-queues table of a database where the queue
    /// table `qtable` (quoted, qualified) is missing too: then [`Error::NotMigrated`]; or
    /// where `qtable` is not an outbox queue table: then [`Error::SchemaMismatch`]. A
    /// statement that names `<table>_paused` first (the claim, the wake-up read, pause and
    /// resume) meets it first on a database never migrated, which alone would mean only the
    /// upgrade is missing. Looked up on `conn` (its failed statement's transaction ended);
    /// when the look-up fails too (inside the caller's aborted transaction), `e` stands.
    pub(crate) async fn unmigrated_or(
        self,
        conn: &mut PgConnection,
        qtable: &str,
        e: Error,
    ) -> Error {
        if !e.is_missing_paused_table() {
            return e;
        }
        // Whether the queue table exists, and whether it is one (an application's table
        // named as the queue table has no paused table either, and `migrate` refuses it:
        // its advice would mislead, found by a fresh-user trial).
        let found = async {
            let mut db = self.on(conn).await?;
            let row = self
                .query(crate::sql::catalog::QUEUE_TABLE_FOUND)
                .bind(qtable)
                .fetch_one(&mut *db)
                .await
                .outbox_sql()?;
            db.done().await?;
            Ok::<(bool, bool), Error>((row.try_get(0).outbox_sql()?, row.try_get(1).outbox_sql()?))
        };
        match found.await {
            Ok((false, _)) => Error::NotMigrated {
                detail: format!("relation {qtable} does not exist"),
            },
            Ok((true, false)) => Error::not_an_outbox_table(
                "acquired_token".to_owned(),
                &format!("{qtable} has no column \"acquired_token\""),
            ),
            _ => e,
        }
    }

    /// Sends the wake-up payloads a distributed statement returned (`sql::text::notify`)
    /// with `wake` (`sql::text::wake`) on `db`, in its transaction when it is in one, so
    /// they go out when it commits and not if it rolls back. A no-op without a `wake`
    /// statement (a single node's statements notify themselves) or without a payload.
    pub(crate) async fn wake(
        self,
        db: &mut PgConnection,
        wake: Option<&SqlStr>,
        payloads: impl IntoIterator<Item = Option<String>>,
    ) -> Result<()> {
        let Some(wake) = wake else {
            return Ok(());
        };
        let payloads: Vec<String> = payloads.into_iter().flatten().collect();
        if payloads.is_empty() {
            return Ok(());
        }
        self.query(wake.clone())
            .bind(payloads)
            .execute(db)
            .await
            .outbox_sql()?;
        Ok(())
    }

    /// Refuses what needs a server session of its own in a pooler's scope, before any SQL
    /// runs: `what` names the operation, `why` the session state it relies on.
    pub(crate) fn require_session(self, what: &'static str, why: &'static str) -> Result<()> {
        match self {
            Scope::Session | Scope::Unnamed => Ok(()),
            Scope::Transaction => Err(Error::SessionRequired { what, why }),
        }
    }
}

/// A connection picked by a [`Scope`]; derefs to the `PgConnection` to run statements on.
pub(crate) enum Db<'c> {
    /// A pooled connection, each statement its own transaction.
    Pooled(PoolConnection<Postgres>),
    /// The caller's connection, in the caller's transaction (or none).
    Borrowed(&'c mut PgConnection),
    /// A transaction of the library's: committed by [`Db::done`], rolled back when dropped.
    Tx(Transaction<'c, Postgres>),
}

impl Db<'static> {
    /// A transaction of `pool`, in every scope, for a run of reads that belong together (the
    /// catalog reads of `validate` and `migrate`): one commit however many reads, where a
    /// session would commit each read as a transaction of its own. Finish it with
    /// [`Db::done`].
    pub(crate) async fn begin(pool: &PgPool) -> Result<Db<'static>> {
        Ok(Db::Tx(pool.begin().await.outbox_sql()?))
    }
}

impl Db<'_> {
    /// Commits the library's own transaction, if it opened one; a no-op otherwise.
    pub(crate) async fn done(self) -> Result<()> {
        if let Db::Tx(tx) = self {
            tx.commit().await.outbox_sql()?;
        }
        Ok(())
    }
}

impl Deref for Db<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match self {
            Db::Pooled(c) => c,
            Db::Borrowed(c) => c,
            Db::Tx(t) => t,
        }
    }
}

impl DerefMut for Db<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match self {
            Db::Pooled(c) => c,
            Db::Borrowed(c) => c,
            Db::Tx(t) => t,
        }
    }
}

/// Binds a distributed outbox's bucket as a statement's last parameter; a single node's
/// statements take none (`None` binds nothing). Every statement that reads or writes one
/// bucket's rows ends with it (see `sql::text::in_bucket`).
pub(crate) trait BindBucket: Sized {
    fn bucket(self, bucket: Option<i16>) -> Self;
}

impl<'q> BindBucket for Query<'q, Postgres, PgArguments> {
    fn bucket(self, bucket: Option<i16>) -> Self {
        match bucket {
            Some(b) => self.bind(b),
            None => self,
        }
    }
}

impl<'q, O> BindBucket for QueryAs<'q, Postgres, O, PgArguments> {
    fn bucket(self, bucket: Option<i16>) -> Self {
        match bucket {
            Some(b) => self.bind(b),
            None => self,
        }
    }
}

impl<'q, O> BindBucket for QueryScalar<'q, Postgres, O, PgArguments> {
    fn bucket(self, bucket: Option<i16>) -> Self {
        match bucket {
            Some(b) => self.bind(b),
            None => self,
        }
    }
}
