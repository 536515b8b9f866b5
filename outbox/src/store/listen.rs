//! Wake-up notifications: a dedicated LISTEN connection that forwards
//! `<deadline as epoch milliseconds>:<queue>` payloads to the worker as [`Wakeup`] hints,
//! and re-LISTENs after a lost connection. The connection comes from a one-connection pool
//! of its own (same connect options as the worker's pool), never from the worker's pool:
//! holding a pool slot for good would leave a small pool without room for claims (a worker
//! must never wait forever on its own pool).

use std::time::Duration;

use chrono::DateTime;
use sqlx::postgres::{PgListener, PgPool, PgPoolOptions};

use super::Wakeup;
use crate::error::{OutboxSql, Result};

/// Starts listening on `channel` and forwards hints until the receiver is dropped. LISTEN
/// is in place when this returns (so a scan after it misses nothing); if it fails, the
/// first hint is [`Wakeup::Lost`] and the loop keeps trying.
pub(crate) async fn start(pool: &PgPool, channel: &str) -> tokio::sync::mpsc::Receiver<Wakeup> {
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    let own = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .max_lifetime(None)
        .idle_timeout(None)
        // Short: when the database is down, the cause is logged (below) within a second.
        .acquire_timeout(Duration::from_secs(1))
        // The session waits idle for notifications by design: an `idle_session_timeout`
        // set on the role or the server (Postgres 14+, SQLSTATE 57P05) would end it at every
        // quiet stretch, and publishes committed until the re-LISTEN would wake nobody.
        // Off for this session only, as a startup parameter (no statement).
        .connect_lazy_with(
            (*pool.connect_options())
                .clone()
                .options([("idle_session_timeout", "0")]),
        );
    let first = match listen(&own, channel).await {
        Ok(l) => Some(l),
        Err(e) => {
            let e = super::connect::explain(pool, e).await;
            tracing::warn!(error = %e, "outbox: LISTEN failed; polling until it is back");
            let _ = tx.try_send(Wakeup::Lost);
            None
        }
    };
    tokio::spawn(listen_loop(own, channel.to_owned(), first, tx));
    rx
}

/// Connects and LISTENs. On a standby in recovery LISTEN fails with SQLSTATE 25006
/// (`Error::ReadOnly`); the loop keeps trying, so the worker hears publishes again once the
/// standby is promoted.
async fn listen(pool: &PgPool, channel: &str) -> Result<PgListener> {
    let mut l = PgListener::connect_with(pool).await.outbox_sql()?;
    l.listen(channel).await.outbox_sql()?;
    Ok(l)
}

/// Parses a notification a publish sends: `<deadline as epoch milliseconds>:<queue>`.
fn parse_notification(payload: &str) -> Option<Wakeup> {
    let (ms, queue) = payload.split_once(':')?;
    let at = DateTime::from_timestamp_millis(ms.parse().ok()?)?;
    Some(Wakeup::Published {
        queue: queue.to_owned(),
        at,
    })
}

/// Forwards notifications until the worker drops the receiver. After a lost connection it
/// reports [`Wakeup::Lost`], re-LISTENs with capped exponential back-off, and reports
/// [`Wakeup::Listening`] only once LISTEN is back, so the worker re-scans after, not
/// before, it can hear new publishes. Postgres delivers a notification only to sessions
/// that were listening when its transaction committed, so a scan made before LISTEN is
/// back could miss a row committed between the scan and the LISTEN.
async fn listen_loop(
    pool: PgPool,
    channel: String,
    mut listener: Option<PgListener>,
    tx: tokio::sync::mpsc::Sender<Wakeup>,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let Some(l) = listener.as_mut() else {
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = tx.closed() => return,
            }
            match listen(&pool, &channel).await {
                Ok(l) => {
                    listener = Some(l);
                    backoff = Duration::from_millis(100);
                    if tx.send(Wakeup::Listening).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let e = super::connect::explain(&pool, e).await;
                    tracing::debug!(error = %e, "outbox: re-LISTEN failed");
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
            continue;
        };
        let got = tokio::select! {
            got = l.try_recv() => got,
            () = tx.closed() => return,
        };
        match got {
            Ok(Some(n)) => {
                if let Some(w) = parse_notification(n.payload()) {
                    if tx.send(w).await.is_err() {
                        return;
                    }
                }
            }
            Ok(None) | Err(_) => {
                tracing::warn!("outbox: the LISTEN connection was lost; polling until it is back");
                listener = None;
                if tx.send(Wakeup::Lost).await.is_err() {
                    return;
                }
            }
        }
    }
}
