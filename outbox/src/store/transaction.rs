//! Completion in the handler's own transaction (SPEC §7.9): a handler of a worker over
//! [`PgStore`](crate::PgStore) begins a transaction on the store's pool, writes through it,
//! and commits it through [`HandlerTransaction::commit`], which runs its row's fenced
//! completion inside that transaction before `COMMIT`. The handler's writes and the
//! completion then commit together or not at all.

use std::sync::{Arc, Mutex};

use sqlx::{PgConnection, PgPool, Postgres};

use super::{Completion, Lease};
use crate::error::{Error, Result};
use crate::outbox::Outbox;

/// What a store offers for handler transactions: only [`PgStore`](crate::PgStore) makes
/// one (its pool and its outbox's statements).
#[derive(Debug, Clone)]
pub struct TransactionSource {
    pool: PgPool,
    outbox: Outbox,
}

impl TransactionSource {
    pub(crate) fn new(pool: PgPool, outbox: Outbox) -> Self {
        TransactionSource { pool, outbox }
    }
}

/// Where one run's transaction stands, as the worker reads it when the handler returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RunTransaction {
    /// No transaction was begun.
    None,
    /// Begun, and neither committed nor rolled back (yet, or ever: dropped).
    Open,
    /// Committed: the row's completion is done.
    Committed(Completion),
    /// Rolled back by the handler.
    RolledBack,
    /// The commit failed and everything was rolled back; the text says why.
    Failed { lease_lost: bool, error: String },
}

/// One run's access to a handler transaction, held by its [`Context`](crate::Context).
#[derive(Clone)]
pub(crate) struct TransactionAccess {
    source: Option<TransactionSource>,
    lease: Lease,
    state: Arc<Mutex<RunTransaction>>,
    /// Run just before the completion in the transaction: the worker marks the lease as
    /// completing, so a renewal that finds the row gone meanwhile does not report it lost.
    before_commit: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl std::fmt::Debug for TransactionAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransactionAccess")
            .field("lease", &self.lease)
            .field("state", &self.state())
            .finish_non_exhaustive()
    }
}

impl TransactionAccess {
    pub(crate) fn new(source: Option<TransactionSource>, lease: Lease) -> Self {
        TransactionAccess {
            source,
            lease,
            state: Arc::new(Mutex::new(RunTransaction::None)),
            before_commit: None,
        }
    }

    /// Sets the hook run just before the completion in the transaction.
    pub(crate) fn before_commit(mut self, hook: Arc<dyn Fn() + Send + Sync>) -> Self {
        self.before_commit = Some(hook);
        self
    }

    /// Where the run's transaction stands.
    pub(crate) fn state(&self) -> RunTransaction {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RunTransaction> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn set(&self, state: RunTransaction) {
        *self.lock() = state;
    }

    pub(crate) async fn begin(&self) -> Result<HandlerTransaction> {
        let Some(source) = &self.source else {
            return Err(Error::TransactionUnavailable {
                reason: "this worker's store has no database transactions (the in-memory store \
                         cannot run a handler's SQL): test transactional handlers against \
                         Postgres"
                    .to_owned(),
            });
        };
        if *self.lock() != RunTransaction::None {
            return Err(Error::TransactionUnavailable {
                reason: "this run already began its transaction (one per run)".to_owned(),
            });
        }
        let tx = match source.pool.begin().await {
            Ok(tx) => tx,
            Err(e) => return Err(crate::error::explain(&source.pool, e.into()).await),
        };
        self.set(RunTransaction::Open);
        Ok(HandlerTransaction {
            tx,
            outbox: source.outbox.clone(),
            access: self.clone(),
        })
    }
}

/// A handler's transaction ([`Context::begin`](crate::Context::begin)) on the worker's
/// database, in `READ COMMITTED` (Postgres' default). Write through it as through any sqlx
/// transaction (`&mut *tx` is a `&mut PgConnection`), then end it with
/// [`commit`](HandlerTransaction::commit), which completes the handler's row in the same
/// transaction, or [`rollback`](HandlerTransaction::rollback).
///
/// Dropped without either (an early `?`, a panic, a timeout), it is rolled back and the run
/// **fails** ("transaction not committed"): it is retried per the strategy, and none of its
/// writes is visible.
#[must_use = "commit it (`tx.commit().await`), which also completes the row, or roll it back; a transaction dropped open rolls back and fails the run"]
pub struct HandlerTransaction {
    tx: sqlx::Transaction<'static, Postgres>,
    outbox: Outbox,
    access: TransactionAccess,
}

impl std::fmt::Debug for HandlerTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerTransaction")
            .field("lease", &self.access.lease)
            .finish_non_exhaustive()
    }
}

impl std::ops::Deref for HandlerTransaction {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.tx
    }
}

impl std::ops::DerefMut for HandlerTransaction {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.tx
    }
}

impl HandlerTransaction {
    /// Completes the handler's row inside this transaction and commits it with everything
    /// the handler wrote (SPEC §7.9): the row is deleted, or its queued rearm applied (a
    /// cancelled timer's row is deleted), exactly as a successful run's completion — one
    /// `DELETE` in the common case, fenced by the run's lease token. Returns what it did.
    ///
    /// The completion locks the timer's row. If an application transaction holds that lock
    /// (an extend of this timer), the commit waits for it, and a rearm the extend queued is
    /// applied. To never deadlock with such a transaction, lock your own rows (write them)
    /// **before** committing, and have application code that touches both lock the domain
    /// rows first and the timer second; a deadlock or a `lock_timeout` you set still rolls
    /// everything back and counts as a failed run.
    ///
    /// # Errors
    /// [`Error::LeaseLost`]: another worker holds the row (or it is gone), so nothing is
    /// committed; [`Error::Database`] if a statement or the `COMMIT` fails (rolled back;
    /// the run counts as failed and is retried per the strategy). A handler returning the
    /// error with `?` is all it takes.
    pub async fn commit(mut self) -> Result<Completion> {
        let lease = self.access.lease;
        if let Some(hook) = &self.access.before_commit {
            hook();
        }
        let done =
            crate::store::postgres::ack_on(&self.outbox.sql().complete, &mut self.tx, lease).await;
        let failed = |lease_lost: bool, error: &Error| RunTransaction::Failed {
            lease_lost,
            error: error.to_string(),
        };
        match done {
            Ok(Completion::LeaseLost) => {
                let e = Error::LeaseLost { id: lease.id };
                self.access.set(failed(true, &e));
                let _ = self.tx.rollback().await;
                Err(e)
            }
            Ok(completion) => match self.tx.commit().await {
                Ok(()) => {
                    self.access.set(RunTransaction::Committed(completion));
                    Ok(completion)
                }
                Err(e) => {
                    let e = Error::from(e);
                    self.access.set(failed(false, &e));
                    Err(e)
                }
            },
            Err(e) => {
                self.access.set(failed(false, &e));
                let _ = self.tx.rollback().await;
                Err(e)
            }
        }
    }

    /// Rolls back everything the handler wrote through this transaction. The run then
    /// ends as the handler's return value says (an `Ok` completes the row in a statement of
    /// its own, as without a transaction).
    ///
    /// # Errors
    /// [`Error::Database`] if the `ROLLBACK` fails (the connection is closed, which rolls
    /// back too).
    pub async fn rollback(self) -> Result<()> {
        self.access.set(RunTransaction::RolledBack);
        self.tx.rollback().await?;
        Ok(())
    }
}
