//! The completer: pipelined acks. A handler slot whose run succeeded hands its row over and
//! takes the next one at once; the completer writes every success waiting, up to
//! `ack_batch_size`, in one fenced statement as soon as its previous statement returned.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tracing::Span;

use super::complete::{settled, write_with_retry, Phase, COMPLETION};
use super::shared::Shared;
use crate::store::{Lease, Store};

/// A success waiting for the completer.
#[derive(Debug, Clone)]
pub(crate) struct PendingAck {
    /// The fence of the delete.
    pub lease: Lease,
    /// For metrics.
    pub queue: String,
    /// The run's `settle` span: it ends once the batched delete reported the row.
    pub span: Span,
    /// The row ends a run of an ordered relay: once it is gone the claim loop looks for its
    /// key's next row.
    pub wakes: bool,
}

/// How many batched completions may be written at once: one normally, so successes pile up
/// into full statements while it runs; another each time every one in flight has waited
/// longer than [`STALLED`] — it met a row locked by an application transaction and finishes
/// its rows one at a time, the locked one waiting for that transaction — so it does not
/// hold up the statements behind it. At most `concurrency + 1`: with pipelined acks the
/// handler slots do not write their own acks, so their connections are the completer's to
/// use for such waits (found by a trial: a fixed two let two application locks stall every
/// ack).
fn flushes_in_flight(concurrency: usize) -> usize {
    concurrency.saturating_add(1)
}

/// How long a batched completion runs before the completer starts the next one beside it:
/// longer than the store's lock timeout (200 ms), so only a write that waits on a lock
/// counts as stalled.
const STALLED: Duration = Duration::from_millis(250);

/// The completer: takes the successes handler tasks hand over and writes everything
/// waiting, up to `ack_batch_size`, in one fenced statement as soon as the previous
/// statement returned. No linger timer: a lone success is written at once, a burst that
/// arrived during one commit shares the next. At shutdown it writes what is left.
pub(crate) async fn completer<S: Store>(
    shared: Arc<Shared<S>>,
    mut rx: mpsc::Receiver<PendingAck>,
) {
    let max = shared.config.ack_batch_size;
    let in_flight = flushes_in_flight(shared.config.concurrency);
    let mut flushes = JoinSet::new();
    let mut newest = Instant::now();
    loop {
        while !flushes.is_empty() {
            let may_start_another = flushes.len() < in_flight;
            tokio::select! {
                _ = flushes.join_next() => {}
                () = tokio::time::sleep_until(newest + STALLED), if may_start_another => break,
            }
        }
        let Some(first) = rx.recv().await else { break };
        let mut batch: Vec<PendingAck> = Vec::with_capacity(max);
        batch.push(first);
        while batch.len() < max {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        newest = Instant::now();
        let shared = shared.clone();
        flushes.spawn(async move { flush(&shared, batch).await });
    }
    while flushes.join_next().await.is_some() {}
}

async fn flush<S: Store>(shared: &Shared<S>, batch: Vec<PendingAck>) {
    let leases: Vec<Lease> = batch.iter().map(|p| p.lease).collect();
    // The batch lives while its shortest lease does.
    let shortest = leases
        .iter()
        .copied()
        .min_by_key(|&l| shared.held.until(l))
        .unwrap_or(leases[0]);
    let results = write_with_retry(shared, shortest, COMPLETION, || {
        shared.store.ack_batch(&leases)
    })
    .await;
    let results = results.map_or_else(
        || vec![None; batch.len()],
        |done| done.into_iter().map(Some).collect(),
    );
    for (pending, done) in batch.iter().zip(results) {
        pending
            .span
            .in_scope(|| settled(shared, &pending.span, &pending.queue, Phase::Ack, done));
        shared.held.remove(pending.lease);
    }
    // The last row of an ordered relay's run is gone: the next row of its key may be
    // claimed now.
    if batch.iter().any(|p| p.wakes) {
        shared.wake_at_local(Instant::now());
    }
}
