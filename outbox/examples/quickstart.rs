//! The README's quick start, run as written: `cargo run -p outbox --example quickstart`.
//!
//! Everything from the first `use` down to the end is the README's two code blocks,
//! verbatim (a test in `tests/integration` fails when they differ). `main` plays the
//! part of a service: it creates the `users` table, runs the block's `run` with a stand-in
//! for the HTTP server (two users ping, one of them logs out), waits for the other's expiry
//! timer to fire, and shuts down. Postgres comes from `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/postgres`); `RUST_LOG` filters the log (default
//! `info`).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use outbox::{Context, Outbox, PgStore, Worker};
use sqlx::PgPool;

/// How long a user stays online after their last ping (a real service would say 30 s or
/// more; 2 s lets the example finish quickly).
const TIMEOUT: Duration = Duration::from_secs(2);

// The macro keeps the struct and generates `publish_presence_expiry`,
// `extend_presence_expiry` and `cancel_presence_expiry`.
#[outbox::timer(queue = "presence.expiry", max_deliveries = 5)]
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct PresenceExpiry {
    pub user_id: i64,
}

/// POST /users/{id}/ping: the domain write and the timer commit together.
async fn ping(pool: &PgPool, user_id: i64) -> Result<(), outbox::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO users (user_id, online, last_seen) VALUES ($1, true, now()) \
         ON CONFLICT (user_id) DO UPDATE SET online = true, last_seen = now()",
    )
    .bind(user_id)
    .execute(&mut *tx)
    .await?;
    // Inserts the timer, moves it later, or, if its handler is running right now, queues
    // a rearm so it fires again for this deadline. TIMEOUT after the database's now().
    let expiry = PresenceExpiry { user_id };
    let done = extend_presence_expiry(&mut *tx, &user_id.to_string(), &expiry, TIMEOUT).await?;
    tx.commit().await?;
    tracing::info!(user_id, ?done, "ping: user online, expiry timer extended");
    Ok(())
}

/// DELETE /users/{id}/session: the user goes offline now and their timer is cancelled.
async fn logout(pool: &PgPool, user_id: i64) -> Result<(), outbox::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("UPDATE users SET online = false WHERE user_id = $1")
        .bind(user_id)
        .execute(&mut *tx)
        .await?;
    let done = cancel_presence_expiry(&mut *tx, &user_id.to_string()).await?;
    tx.commit().await?;
    tracing::info!(
        user_id,
        ?done,
        "logout: user offline, expiry timer cancelled"
    );
    Ok(())
}

/// Shared state, given to the worker once; handlers ask for a field by its type.
#[derive(Clone, Default, outbox::FromRef)]
struct AppState {
    went_offline: Arc<AtomicU64>,
}

/// The timer fired. In the handler's own transaction: the UPDATE waits for a concurrent
/// ping's lock on the user's row and re-checks `last_seen` on the committed row (a ping
/// that won the race keeps the user online, and its rearm fires later); `commit` then
/// completes the timer's row in the same transaction, so the offline write and the
/// completion commit together or not at all. Lock order as in `ping`: user row, then timer.
async fn on_expiry(t: PresenceExpiry, ctx: Context<AppState>) -> Result<(), outbox::Error> {
    let mut tx = ctx.begin().await?;
    let done = sqlx::query(
        "UPDATE users SET online = false \
         WHERE user_id = $1 AND online AND last_seen + make_interval(secs => $2) <= now()",
    )
    .bind(t.user_id)
    .bind(TIMEOUT.as_secs_f64())
    .execute(&mut *tx)
    .await?;
    tx.commit().await?; // an Err (or any `?` above) rolls back and retries with back-off
    if done.rows_affected() == 1 {
        ctx.state::<Arc<AtomicU64>>()
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!(user_id = t.user_id, "expiry: user went offline");
    }
    Ok(())
}

/// The service's life: the outbox tables, the worker, then `serve` (your HTTP server)
/// until it returns, then a graceful shutdown.
async fn run(
    pool: PgPool,
    state: AppState,
    serve: impl Future<Output = ()>,
) -> Result<(), outbox::Error> {
    outbox::migrate(&pool).await?; // idempotent, online: safe at every start
    Outbox::default().validate_schema(&pool).await?; // every problem at once
    let worker = Worker::builder(PgStore::new(pool, Outbox::default()))
        .state(state)
        .timer::<PresenceExpiry>(on_expiry)
        .concurrency(4) // needs 4 + 2 connections of the pool; the rest serve requests
        .build()?
        .start();
    tracing::info!("outbox tables ready, worker started");
    serve.await;
    let report = worker.shutdown().await; // running handlers finish, within graceful_timeout
    tracing::info!(?report, "worker stopped");
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Without a subscriber the library's logs go nowhere. RUST_LOG overrides the filter.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "info,sqlx::postgres::notice=warn".into());
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stdout());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .init();

    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(10)
        .connect(&url)
        .await
        .map_err(|e| format!("cannot connect to {url}: {e} (is Postgres running?)"))?;
    // The domain table `ping`, `logout` and `on_expiry` write.
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS users (user_id bigint PRIMARY KEY, \
         online boolean NOT NULL DEFAULT false, last_seen timestamptz)",
    )
    .execute(&pool)
    .await?;

    // A stand-in for the HTTP server: user 1 pings; user 2 pings and logs out; then it
    // waits (at most 10 s) for user 1's timer to fire, where a server would wait for Ctrl-C.
    let state = AppState::default();
    let fired = Arc::clone(&state.went_offline);
    let requests = async {
        ping(&pool, 1).await?;
        ping(&pool, 2).await?;
        logout(&pool, 2).await?;
        let give_up = tokio::time::Instant::now() + Duration::from_secs(10);
        while fired.load(Ordering::Relaxed) == 0 && tokio::time::Instant::now() < give_up {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok::<(), outbox::Error>(())
    };
    let mut served = Ok(());
    run(pool.clone(), state, async { served = requests.await }).await?;
    served?;

    // User 1 went offline by its timer, user 2 by its logout (its timer never ran).
    let online: Vec<i64> = sqlx::query_scalar("SELECT user_id FROM users WHERE online")
        .fetch_all(&pool)
        .await?;
    let expiries = fired.load(Ordering::Relaxed);
    if !online.is_empty() || expiries != 1 {
        return Err(format!(
            "expected nobody online after one expiry: online {online:?}, {expiries} expiries"
        )
        .into());
    }
    tracing::info!("done: user 1 expired, user 2 logged out");
    Ok(())
}
