//! Completion in the handler's own transaction: a handler of a worker over
//! [`PgStore`](crate::PgStore) begins a transaction on the store's pool, writes through it,
//! and commits it through [`HandlerTransaction::commit`], which runs its row's fenced
//! completion inside that transaction before `COMMIT`. The handler's writes and the
//! completion then commit together or not at all.
//!
//! The run's transaction goes through these states, which the worker reads once the
//! handler has returned (or was stopped):
//!
//! ```text
//! None ─begin─▶ Open ─commit─▶ Committing ─▶ Committed | Failed
//!                 ├─rollback─▶ RolledBack
//!                 ├─dropped──▶ Dropped            (rolled back by sqlx)
//!                 └─handler returned, still open elsewhere─▶ Abandoned (can no longer commit)
//! ```
//!
//! The commit itself runs in a task of its own, so stopping the handler (its timeout,
//! shutdown) never cuts a `COMMIT` in flight: the worker waits for it and reports what it
//! did.

use std::sync::Arc;

use sqlx::{PgConnection, Postgres};
use tokio::sync::watch;

use super::{Completion, Lease, TransactionSource};
use crate::error::{Error, OutboxSql, Result};
use crate::scope::{Db, Scope};
use crate::sql::complete::Complete;

/// Where one run's transaction stands (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RunTransaction {
    /// No transaction was begun.
    None,
    /// Begun, and neither committed nor rolled back yet.
    Open,
    /// `commit` is running.
    Committing,
    /// Committed: the row's completion is done.
    Committed(Completion),
    /// Rolled back by the handler.
    RolledBack,
    /// Dropped open by the handler (an early return, a panic, its timeout): rolled back.
    Dropped,
    /// Still open when the run ended (moved out of the handler): it can no longer commit.
    Abandoned,
    /// The commit failed and everything was rolled back; the text says why.
    Failed { lease_lost: bool, error: String },
}

/// What the worker does around a commit: the lease is kept from being reported lost while
/// the commit may delete the row, and is no longer held once it did.
pub(crate) trait CommitHooks: Send + Sync {
    /// The commit starts.
    fn committing(&self);
    /// The commit failed: everything was rolled back, the run goes on.
    fn failed(&self);
    /// The commit landed: the row is completed.
    fn committed(&self);
}

/// One run's access to a handler transaction, held by its [`Context`](crate::Context).
#[derive(Clone)]
pub(crate) struct TransactionAccess {
    source: Option<TransactionSource>,
    lease: Lease,
    state: Arc<watch::Sender<RunTransaction>>,
    hooks: Option<Arc<dyn CommitHooks>>,
}

impl std::fmt::Debug for TransactionAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransactionAccess")
            .field("lease", &self.lease)
            .field("state", &*self.state.borrow())
            .finish_non_exhaustive()
    }
}

impl TransactionAccess {
    pub(crate) fn new(source: Option<TransactionSource>, lease: Lease) -> Self {
        TransactionAccess {
            source,
            lease,
            state: Arc::new(watch::channel(RunTransaction::None).0),
            hooks: None,
        }
    }

    /// Sets what the worker does around a commit.
    pub(crate) fn hooks(mut self, hooks: Arc<dyn CommitHooks>) -> Self {
        self.hooks = Some(hooks);
        self
    }

    fn set(&self, state: RunTransaction) {
        self.state.send_replace(state);
    }

    /// Moves from `from` to `to`; false if the state was another.
    fn transition(&self, from: &RunTransaction, to: RunTransaction) -> bool {
        self.state.send_if_modified(|s| {
            if s == from {
                *s = to;
                true
            } else {
                false
            }
        })
    }

    /// The state once the run has ended: waits for a commit in flight, and turns a
    /// transaction still open (moved out of the handler) into `Abandoned`, so a later
    /// `commit` of it refuses.
    pub(crate) async fn settle(&self) -> RunTransaction {
        let mut rx = self.state.subscribe();
        // The sender lives in `self`, so the wait ends only with a state change.
        let _ = rx.wait_for(|s| *s != RunTransaction::Committing).await;
        self.transition(&RunTransaction::Open, RunTransaction::Abandoned);
        let state = self.state.borrow().clone();
        state
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
        if *self.state.borrow() != RunTransaction::None {
            return Err(Error::TransactionUnavailable {
                reason: "this run already began its transaction (one per run)".to_owned(),
            });
        }
        // READ COMMITTED whatever the session's default: the completion must see the row
        // as renewals and extends left it (SPEC §5.3), which a snapshot taken at the start
        // of the transaction would refuse with a serialization failure.
        let begun = source
            .pool
            .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await;
        let tx = match begun {
            Ok(tx) => tx,
            Err(e) => {
                return Err(
                    super::connect::explain(&source.pool, Error::from_outbox_statement(e)).await,
                )
            }
        };
        if !self.transition(&RunTransaction::None, RunTransaction::Open) {
            return Err(Error::TransactionUnavailable {
                reason: "this run already began its transaction (one per run)".to_owned(),
            });
        }
        Ok(HandlerTransaction {
            tx: Some(tx),
            complete: source.complete.clone(),
            scope: source.scope,
            access: self.clone(),
        })
    }
}

/// A handler's transaction ([`Context::begin`](crate::Context::begin)) on the worker's
/// database, always `READ COMMITTED` (do not raise it with `SET TRANSACTION`: a renewal
/// of the run's lease or an extend of its timer during the run would then make the commit
/// fail with a serialization error). Write through it as through any sqlx transaction
/// (`&mut *tx` is a `&mut PgConnection`), then end it with
/// [`commit`](HandlerTransaction::commit), which completes the handler's row in the same
/// transaction, or [`rollback`](HandlerTransaction::rollback).
///
/// Dropped without either (an early `?`, a panic, a timeout), it is rolled back and the run
/// **fails** ("transaction not committed"): it is retried per the strategy, and none of its
/// writes is visible. Moved out of the handler (into a spawned task) and still open when
/// the handler returns, the run fails the same way and the transaction can no longer
/// commit.
#[must_use = "commit it (`tx.commit().await`), which also completes the row, or roll it back; a transaction dropped open rolls back and fails the run"]
pub struct HandlerTransaction {
    /// `None` once committed or rolled back.
    tx: Option<sqlx::Transaction<'static, Postgres>>,
    /// The statements of the row's completion (its outbox's).
    complete: Complete,
    /// How they are sent (unnamed through a pooler).
    scope: Scope,
    access: TransactionAccess,
}

impl std::fmt::Debug for HandlerTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerTransaction")
            .field("lease", &self.access.lease)
            .finish_non_exhaustive()
    }
}

impl Drop for HandlerTransaction {
    fn drop(&mut self) {
        if self.tx.is_some() {
            // sqlx rolls the transaction back as the connection goes back to the pool.
            self.access
                .transition(&RunTransaction::Open, RunTransaction::Dropped);
        }
    }
}

impl std::ops::Deref for HandlerTransaction {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        self.tx
            .as_deref()
            .expect("a HandlerTransaction holds its transaction until commit or rollback")
    }
}

impl std::ops::DerefMut for HandlerTransaction {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.tx
            .as_deref_mut()
            .expect("a HandlerTransaction holds its transaction until commit or rollback")
    }
}

impl HandlerTransaction {
    /// Completes the handler's row inside this transaction and commits it with everything
    /// the handler wrote: the row is deleted, or its queued rearm applied (a cancelled
    /// timer's row is deleted), exactly as a successful run's completion — one `DELETE` in
    /// the common case, fenced by the run's lease token. Returns what it did. When another
    /// worker has re-claimed the row, the fenced `DELETE` matches nothing, and the whole
    /// transaction is rolled back: a stale worker's writes never become visible.
    ///
    /// The completion locks the timer's row. If an application transaction holds that lock
    /// (an extend of this timer), the commit waits for it, and a rearm the extend queued is
    /// applied. To never deadlock with such a transaction, lock your own rows (write them)
    /// **before** committing, and have application code that touches both lock the domain
    /// rows first and the timer second; a deadlock or a `lock_timeout` you set still rolls
    /// everything back and counts as a failed run.
    ///
    /// Once started, the commit finishes even if the handler is stopped meanwhile (its
    /// timeout, shutdown): the worker waits for it and reports what it did.
    ///
    /// # Errors
    /// [`Error::LeaseLost`]: another worker holds the row (or it is gone), so nothing is
    /// committed; [`Error::Database`] if a statement or the `COMMIT` fails (rolled back;
    /// the run counts as failed and is retried per the strategy);
    /// [`Error::TransactionUnavailable`] if the run already ended (the transaction was moved
    /// out of the handler): rolled back. Returning the error with `?` is all it takes.
    pub async fn commit(mut self) -> Result<Completion> {
        let tx = self.tx.take().expect("held until commit or rollback");
        let access = self.access.clone();
        if !access.transition(&RunTransaction::Open, RunTransaction::Committing) {
            drop(tx);
            return Err(Error::TransactionUnavailable {
                reason: "the run this transaction belongs to has ended; it was rolled back"
                    .to_owned(),
            });
        }
        if let Some(hooks) = &access.hooks {
            hooks.committing();
        }
        let complete = self.complete.clone();
        let task = tokio::spawn(commit_in_task(tx, complete, self.scope, access.clone()));
        match task.await {
            Ok(done) => done,
            Err(e) => {
                let error = Error::TransactionUnavailable {
                    reason: format!("the commit task failed: {e}"),
                };
                access.set(RunTransaction::Failed {
                    lease_lost: false,
                    error: error.to_string(),
                });
                Err(error)
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
    pub async fn rollback(mut self) -> Result<()> {
        let tx = self.tx.take().expect("held until commit or rollback");
        self.access
            .transition(&RunTransaction::Open, RunTransaction::RolledBack);
        tx.rollback().await.outbox_sql()?;
        Ok(())
    }
}

/// The completion and the `COMMIT`, in a task of its own (see the module docs).
async fn commit_in_task(
    mut tx: sqlx::Transaction<'static, Postgres>,
    complete: Complete,
    scope: Scope,
    access: TransactionAccess,
) -> Result<Completion> {
    let lease = access.lease;
    let done = super::fenced::ack_on(&complete, scope, Db::Borrowed(&mut tx), lease).await;
    let result = match done {
        Ok(Completion::LeaseLost) => {
            let _ = tx.rollback().await;
            Err(Error::LeaseLost { id: lease.id })
        }
        Ok(completion) => tx
            .commit()
            .await
            .map(|()| completion)
            // A COMMIT runs the caller's deferred constraints and triggers: its error is
            // theirs, never one of the library's schema (so `Database`, not `NotMigrated`).
            .map_err(Error::from),
        Err(e) => {
            let _ = tx.rollback().await;
            Err(e)
        }
    };
    match &result {
        Ok(completion) => {
            access.set(RunTransaction::Committed(*completion));
            if let Some(hooks) = &access.hooks {
                hooks.committed();
            }
        }
        Err(e) => {
            access.set(RunTransaction::Failed {
                lease_lost: matches!(e, Error::LeaseLost { .. }),
                error: e.to_string(),
            });
            if let Some(hooks) = &access.hooks {
                hooks.failed();
            }
        }
    }
    result
}
