//! Deciding a run: the `max_deliveries` check, decoding, the handler call (a panic and the
//! timeout are failed runs), what the handler did with its transaction, and the retry
//! strategy, turning a claimed delivery into a [`Decision`] without touching storage. The
//! registered handlers ([`Route`]) are type-erased here.

use std::any::type_name;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use tokio::sync::watch;

use super::circuit::Circuit;
use super::handler::{
    CancelReason, Context, Handler, HandlerOptions, Outcome, DEFAULT_MAX_DELIVERIES,
};
use super::retry::RetryStrategy;
use crate::error::Result;
use crate::periodic::Recurrence;
use crate::store::transaction::{RunTransaction, TransactionAccess};
use crate::store::{Completion, Delivery, FailureReason};
use crate::timer::Timer;

/// What to do with a delivery once its handler, or the checks before it, are done.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Decision {
    /// Success.
    Ack,
    /// A failed run, retried after `delay`.
    Retry {
        /// The delay chosen by the strategy or the handler.
        delay: Duration,
        /// The handler's error text.
        error: String,
    },
    /// A terminal failure.
    Fail {
        /// Why.
        reason: FailureReason,
        /// The error text, if any.
        error: Option<String>,
    },
    /// The handler committed its transaction ([`Context::begin`]), which completed the
    /// row: nothing is left to write.
    Completed {
        /// What the completion in the handler's transaction did.
        completion: Completion,
    },
}

/// Decodes and calls, type-erased.
pub(crate) trait Erased: Send + Sync + 'static {
    /// `Err` carries the decode error text.
    fn dispatch(&self, payload: &[u8], ctx: Context)
        -> Result<BoxFuture<'static, Outcome>, String>;
}

struct Typed<T, H, St> {
    handler: H,
    state: Arc<St>,
    _t: PhantomData<fn(T)>,
}

impl<T: Timer, St: Send + Sync + 'static, H: Handler<T, St>> Erased for Typed<T, H, St> {
    fn dispatch(
        &self,
        payload: &[u8],
        ctx: Context,
    ) -> Result<BoxFuture<'static, Outcome>, String> {
        let value = T::decode(payload)
            .map_err(|e| format!("the payload does not decode as {}: {e}", type_name::<T>()))?;
        Ok(self.handler.call(value, ctx.with_state(self.state.clone())))
    }
}

struct Raw<H, St> {
    handler: H,
    state: Arc<St>,
}

impl<St: Send + Sync + 'static, H: Handler<Vec<u8>, St>> Erased for Raw<H, St> {
    fn dispatch(
        &self,
        payload: &[u8],
        ctx: Context,
    ) -> Result<BoxFuture<'static, Outcome>, String> {
        Ok(self
            .handler
            .call(payload.to_vec(), ctx.with_state(self.state.clone())))
    }
}

/// A registered handler with its settings.
#[derive(Clone)]
pub(crate) struct Route {
    pub queue: String,
    /// For error messages: the payload type or the handler's type name.
    pub name: String,
    pub handler: Arc<dyn Erased>,
    pub max_deliveries: u32,
    pub retry: RetryStrategy,
    pub timeout: Option<Duration>,
    /// The most rows of the queue held at once (buffered or running), if limited.
    pub max_concurrency: Option<usize>,
    /// The schedules of this queue the worker registered, by timer id (`schedule:<name>`).
    pub schedules: HashMap<String, Recurrence>,
    /// A relay's circuit: claims paused while its sink is down, rows given back.
    pub circuit: Option<Arc<Circuit>>,
    /// A relay ordered per key: the header whose value is the key. Its rows are claimed by
    /// `Store::claim_in_order`, never by the worker's common claim.
    pub ordered_by: Option<String>,
}

impl Route {
    pub(crate) fn typed<T, H, St>(handler: H, state: Arc<St>, options: HandlerOptions) -> Self
    where
        T: Timer,
        St: Send + Sync + 'static,
        H: Handler<T, St>,
    {
        Route {
            queue: T::QUEUE.to_owned(),
            name: type_name::<T>().to_owned(),
            handler: Arc::new(Typed {
                handler,
                state,
                _t: PhantomData,
            }),
            max_deliveries: options.max_deliveries.unwrap_or(T::MAX_DELIVERIES),
            retry: options.retry,
            timeout: options.timeout,
            max_concurrency: options.max_concurrency,
            schedules: HashMap::new(),
            circuit: None,
            ordered_by: None,
        }
    }

    pub(crate) fn raw<H, St>(
        queue: String,
        handler: H,
        state: Arc<St>,
        options: HandlerOptions,
    ) -> Self
    where
        St: Send + Sync + 'static,
        H: Handler<Vec<u8>, St>,
    {
        Route {
            queue,
            name: format!("raw handler {}", type_name::<H>()),
            handler: Arc::new(Raw { handler, state }),
            max_deliveries: options.max_deliveries.unwrap_or(DEFAULT_MAX_DELIVERIES),
            retry: options.retry,
            timeout: options.timeout,
            max_concurrency: options.max_concurrency,
            schedules: HashMap::new(),
            circuit: None,
            ordered_by: None,
        }
    }
}

/// A run's decision and, when the run failed, the class of its failure: the `error.type`
/// of its `process` span (the list is in [`crate::telemetry`]).
#[derive(Debug)]
pub(crate) struct Decided {
    pub(crate) decision: Decision,
    pub(crate) error_type: Option<&'static str>,
}

impl Decided {
    fn new(decision: Decision, error_type: &'static str) -> Self {
        Decided {
            decision,
            error_type: Some(error_type),
        }
    }
}

/// Runs one delivery through its route: the `max_deliveries` check, decoding, the handler
/// (a panic is a failed run, and so is a run past the route's timeout), and the retry
/// strategy. Touches no storage. `stop` is the signal the handler's context listens to.
pub(crate) async fn decide(
    route: &Route,
    delivery: &Delivery,
    stop: watch::Receiver<Option<CancelReason>>,
    transaction: TransactionAccess,
) -> Decided {
    if i64::from(delivery.deliveries_count) > i64::from(route.max_deliveries) {
        let decision = Decision::Fail {
            reason: FailureReason::MaxDeliveries,
            error: Some(format!(
                "delivered {} times; max_deliveries is {}",
                delivery.deliveries_count, route.max_deliveries
            )),
        };
        return Decided::new(decision, "max_deliveries");
    }
    if let Some(problem) = &delivery.decode_error {
        // The stored row itself does not decode: no handler can run it, and retrying it
        // would only fail the same way (SPEC §7.4).
        let decision = Decision::Fail {
            reason: FailureReason::DecodeError,
            error: Some(format!("the stored row does not decode: {problem}")),
        };
        return Decided::new(decision, "decode_error");
    }
    let ctx = Context::new(delivery, stop, transaction.clone());
    // A panic is a failed run wherever it happens: while decoding (a hand-written
    // Deserialize), in the synchronous part of a handler closure, or in its future. None
    // may take the worker's handler task down.
    let panicked = |p: Box<dyn std::any::Any + Send>| {
        (
            Outcome::Retry(format!("handler panicked: {}", panic_text(&*p))),
            Some("panic"),
        )
    };
    let dispatched = std::panic::catch_unwind(AssertUnwindSafe(|| {
        route.handler.dispatch(&delivery.payload, ctx)
    }));
    let mut timed_out = false;
    // `cause`: the failure class when the run itself failed (a panic or the timeout);
    // otherwise what the handler returned says it.
    let (result, cause) = match dispatched {
        Ok(Ok(fut)) => {
            let run = AssertUnwindSafe(fut).catch_unwind();
            let outcome = match route.timeout {
                Some(limit) => tokio::time::timeout(limit, run).await.ok(),
                None => Some(run.await),
            };
            match outcome {
                Some(Ok(done)) => (done, None),
                Some(Err(p)) => panicked(p),
                None => {
                    timed_out = true;
                    let limit = route.timeout.unwrap_or_default();
                    tracing::warn!(
                        id = delivery.lease.id,
                        queue = %delivery.queue,
                        handler = %route.name,
                        timeout_ms = limit.as_millis() as u64,
                        "outbox: handler timed out; its run is stopped and counts as failed"
                    );
                    (
                        Outcome::Retry(format!("handler timed out after {limit:?}")),
                        Some("timeout"),
                    )
                }
            }
        }
        Ok(Err(e)) => {
            let decision = Decision::Fail {
                reason: FailureReason::DecodeError,
                error: Some(e),
            };
            return Decided::new(decision, "decode_error");
        }
        Err(p) => panicked(p),
    };
    // What the handler did with its transaction decides before what it returned (SPEC
    // §7.9). Its future is done or dropped by now; a commit in flight is waited for.
    let (result, cause) = match (transaction.settle().await, result) {
        (RunTransaction::None | RunTransaction::RolledBack, result) => (result, cause),
        (RunTransaction::Committed(completion), result) => {
            if result != Outcome::Ack {
                tracing::warn!(
                    outcome = ?result,
                    "outbox: the handler committed its transaction (which completed the row) and then reported a failure; the commit stands"
                );
            }
            return Decided {
                decision: Decision::Completed { completion },
                error_type: None,
            };
        }
        (
            RunTransaction::Failed {
                lease_lost: true, ..
            },
            _,
        ) => {
            let decision = Decision::Completed {
                completion: Completion::LeaseLost,
            };
            return Decided::new(decision, "lease_lost");
        }
        (RunTransaction::Failed { error, .. }, Outcome::Ack) => (
            Outcome::Retry(format!(
                "the handler's transaction failed to commit (rolled back): {error}"
            )),
            Some("transaction_error"),
        ),
        (uncommitted @ (RunTransaction::Dropped | RunTransaction::Abandoned), Outcome::Ack) => {
            let error = if matches!(uncommitted, RunTransaction::Dropped) {
                "transaction not committed: the handler began a transaction and returned without committing or rolling it back (it was rolled back)"
            } else {
                "transaction not committed: the handler returned while its transaction was still open elsewhere; it can no longer commit, and rolls back when dropped"
            };
            // A mistake in the handler, not a failure of the run: said at WARN (the retry
            // itself is logged at INFO, like any failed run).
            tracing::warn!("outbox: {error}; the run counts as failed");
            (Outcome::Retry(error.to_owned()), Some("transaction_error"))
        }
        // Open and Committing are resolved by `settle`.
        (_, failed) => (failed, cause),
    };
    let failures = u32::try_from(delivery.attempts_count)
        .unwrap_or(0)
        .saturating_add(1);
    let elapsed = delivery
        .first_attempt_at
        .and_then(|first| (delivery.claimed_at - first).to_std().ok())
        .unwrap_or_default();
    match result {
        Outcome::Ack => Decided {
            decision: Decision::Ack,
            error_type: None,
        },
        Outcome::Reject(e) => Decided::new(
            Decision::Fail {
                reason: FailureReason::Rejected,
                error: Some(e),
            },
            "rejected",
        ),
        Outcome::Retry(error) => {
            let decision = match route
                .retry
                .next_delay(failures, elapsed, rand::random::<f64>())
            {
                Some(delay) => Decision::Retry { delay, error },
                None => Decision::Fail {
                    reason: if timed_out {
                        FailureReason::Timeout
                    } else {
                        FailureReason::RetryExhausted
                    },
                    error: Some(error),
                },
            };
            Decided::new(decision, cause.unwrap_or("handler_error"))
        }
        Outcome::RetryAfter(delay) => {
            let delay = delay.min(super::retry::MAX_RETRY_DELAY);
            // An explicit delay replaces the strategy's, but its attempt limit still holds.
            // The run itself did not fail (the handler asked for it): no error class until
            // the attempts are exhausted.
            if route.retry.allows_another(failures) {
                Decided {
                    decision: Decision::Retry {
                        delay,
                        error: format!("handler asked to retry after {delay:?}"),
                    },
                    error_type: None,
                }
            } else {
                let decision = Decision::Fail {
                    reason: FailureReason::RetryExhausted,
                    error: Some(format!(
                        "handler asked to retry after {delay:?}; attempts exhausted"
                    )),
                };
                Decided::new(decision, "retry_exhausted")
            }
        }
    }
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}
