//! A web dashboard for [`outbox`] queues: server-rendered pages for operators, as an axum
//! [`Router`] that an application nests under a path of its own, and served
//! by `outbox ui` (the `outbox-cli` crate).
//!
//! ```no_run
//! # async fn f(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let outbox = outbox::Outbox::builder().dead_letter(true).build()?;
//! let dashboard = outbox_ui::Dashboard::new(outbox, pool)?;
//! let app: axum::Router = axum::Router::new()
//!     // .route("/", …) the application's own routes
//!     .nest("/outbox", dashboard.router());
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! axum::serve(listener, app).await?;
//! # Ok(()) }
//! ```
//!
//! # Pages
//!
//! | path (under the mount) | what |
//! |---|---|
//! | `/` | every queue: pending, due, leased, expired leases, lateness, rearms, paused, dead letters, rows finished per second (with [`Dashboard::install_throughput_counter`]), a sparkline; refreshed every 5 s by a small script |
//! | `/queue?name={queue}` | its live rows by deadline, 50 a page (keyset), filtered by state, searched by id or timer id (the name in the query, so `.`, `..` and names with `/` work; `/queues/{queue}` is served too) |
//! | `/rows/{id}` | one live row: payload (its JSON text re-indented when it parses, a hex dump otherwise; at most [`MAX_SHOWN_BYTES`] of its bytes), headers, deadlines, counters, queued rearm, cancel mark, lease (held, or expired and claimable again) |
//! | `/rows/{id}/download/{part}` | `payload`, `headers`, `rearm-payload`, `rearm-headers`: the stored bytes whole, as an `application/octet-stream` attachment |
//! | `/dead-letters` | dead letters by id, filtered by queue, reason and redrive state; redrive and purge (each asks first) |
//! | `/dead-letters/{id}/download/{part}` | `payload`, `headers`, as above |
//! | `/schedules` | periodic schedules (keyed `schedule:<name>`): recurrence, next instant, last run |
//! | `/schema` | the schema check and the migration steps not applied yet |
//!
//! # Safety
//!
//! Every value read from the database is escaped (the pages are built with [`maud`], which
//! escapes every interpolated value). A state-changing request is a `POST` that carries the
//! dashboard's CSRF token (a random value made by [`Dashboard::new`], embedded in its
//! forms) and, when the browser sends an `Origin` (or else a `Referer`) header, comes from
//! the same host as the `Host` header; anything else is answered `403 Forbidden` and
//! changes nothing. Actions on one row use the library's own statements, which never move
//! or delete a row a worker holds ([`outbox::admin::RowAction::Leased`]); the dashboard
//! offers no action on a leased row but cancelling the timer of a row whose lease expired.
//! The notice an action's redirect carries is signed with a key of the dashboard (HMAC-SHA256)
//! and shown for 10 minutes: a link with `?ok=` or `?error=` text of its own shows nothing.
//! Pages render at most [`MAX_SHOWN_BYTES`] bytes of a payload or of headers; the rest is a
//! download. [`Dashboard::read_only`] removes every action:
//! no form is rendered and every `POST` is refused.
//!
//! The router authenticates nobody: nest it behind the application's own authentication
//! (a middleware on the nested router, see the guide's dashboard page), or use
//! [`basic_auth`] (what `outbox ui --basic-auth` does).
//!
//! # Cost
//!
//! Every statement reaches its table through an index. The queue statistics use
//! [`StatsMode::Exact`](outbox::stats::StatsMode::Exact) while the queue and dead-letter
//! tables are small (under [`EXACT_STATS_MAX_BYTES`] each) and
//! [`StatsMode::Estimate`](outbox::stats::StatsMode::Estimate) above; the due count is
//! exact up to [`DUE_COUNT_CAP`] and shown as "more than" beyond.

#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod actions;
mod download;
mod error;
mod format;
mod guard;
mod history;
mod layout;
mod limits;
mod notice;
mod pages;
mod sql;
mod state;
#[cfg(test)]
mod tests;
mod throughput;

use std::sync::Arc;
use std::time::Duration;

use axum::routing::{get, post};
use axum::Router;
use outbox::Outbox;
use sqlx::PgPool;

use crate::actions::{QueueOp, RowOp};
pub use crate::error::UiError;
pub use crate::guard::{basic_auth, security_headers};
pub use crate::limits::{
    DUE_COUNT_CAP, EXACT_STATS_MAX_BYTES, LIST_SHOWN_BYTES, MAX_PAGE_SIZE, MAX_SHOWN_BYTES,
};
use crate::state::{Inner, State};

/// The dashboard: an [`Outbox`] and the pool it reads with, and its settings. Build it
/// with [`Dashboard::new`], then [`Dashboard::router`].
#[derive(Debug)]
pub struct Dashboard {
    outbox: Outbox,
    pool: PgPool,
    read_only: bool,
    lease_ttl: Duration,
    page_size: usize,
}

impl Dashboard {
    /// A dashboard over `outbox`'s tables, read and written through `pool` (the
    /// application's pool; the dashboard holds one connection per request while it runs).
    /// Actions are on; the lease TTL used to call a lease expired is 60 s (the worker's
    /// default); 50 rows a page.
    ///
    /// # Errors
    /// [`UiError::Distributed`] for a distributed `Outbox`.
    pub fn new(outbox: Outbox, pool: PgPool) -> Result<Self, UiError> {
        if outbox.buckets().is_some() {
            return Err(UiError::Distributed);
        }
        Ok(Dashboard {
            outbox,
            pool,
            read_only: false,
            lease_ttl: Duration::from_secs(60),
            page_size: 50,
        })
    }

    /// Read-only: no action is rendered and every `POST` is answered `403 Forbidden`.
    pub fn read_only(mut self, on: bool) -> Self {
        self.read_only = on;
        self
    }

    /// The lease TTL of the workers (their `WorkerBuilder::lease_ttl`): a leased row older
    /// than this is shown as an expired lease.
    ///
    /// # Errors
    /// [`UiError::InvalidSetting`] outside the range `WorkerBuilder::lease_ttl` accepts,
    /// 100 ms to 7 days (a longer one would overflow the statistics' arithmetic, and no
    /// worker runs with it).
    pub fn lease_ttl(mut self, ttl: Duration) -> Result<Self, UiError> {
        // The worker's own bounds (outbox/src/worker/config.rs, `Config::validate`).
        const MIN: Duration = Duration::from_millis(100);
        const MAX: Duration = Duration::from_secs(7 * 24 * 3600);
        if !(MIN..=MAX).contains(&ttl) {
            return Err(UiError::InvalidSetting {
                field: "lease_ttl",
                reason: format!(
                    "must be 100ms to 7d, the range of WorkerBuilder::lease_ttl, not {}",
                    humantime::format_duration(ttl)
                ),
            });
        }
        self.lease_ttl = ttl;
        Ok(self)
    }

    /// Rows (or dead letters) per page, 1 to [`MAX_PAGE_SIZE`].
    ///
    /// # Errors
    /// [`UiError::InvalidSetting`] outside that range.
    pub fn page_size(mut self, rows: usize) -> Result<Self, UiError> {
        if !(1..=MAX_PAGE_SIZE).contains(&rows) {
            return Err(UiError::InvalidSetting {
                field: "page_size",
                reason: format!("must be 1 to {MAX_PAGE_SIZE}, not {rows}"),
            });
        }
        self.page_size = rows;
        Ok(self)
    }

    /// Installs the per-queue throughput counter: a table `<table>_finished` beside the
    /// queue table and a statement-level `AFTER DELETE` trigger on it that counts, per
    /// queue, the rows each statement deletes (acks, cancels, deletes, dead-lettering);
    /// the queues page then shows rows finished per second of each queue over the last 5
    /// minutes. Idempotent. The dashboard never installs it by itself: it adds one small
    /// upsert per queue to each statement that deletes queue rows (one counter row per
    /// queue, backend and minute, so completers never wait on each other), which is the
    /// operator's call. Needs the right to create tables and triggers on the queue table;
    /// the trigger's lock on the queue table is waited for at most 5 s.
    ///
    /// The trigger's function is `SECURITY DEFINER` (with a fixed `search_path`): it writes
    /// the counter as the role that installed it, so the roles that delete queue rows (the
    /// workers') need no right on the counter table. Remove it with
    /// [`Dashboard::remove_throughput_counter`]; a counter table dropped by hand leaves a
    /// trigger that counts nothing (it looks the table up first), never one that fails acks.
    ///
    /// # Errors
    /// [`UiError::NoQueueTable`] before the outbox's migrations; [`UiError::Database`] when
    /// a statement fails (rights, lock timeout).
    pub async fn install_throughput_counter(&self) -> Result<(), UiError> {
        throughput::install(&self.outbox, &self.pool).await
    }

    /// Removes what [`Dashboard::install_throughput_counter`] made (trigger, function,
    /// counter table); the queues page then shows the table-wide figure only.
    ///
    /// # Errors
    /// [`UiError::Database`] when a statement fails.
    pub async fn remove_throughput_counter(&self) -> Result<(), UiError> {
        Ok(throughput::remove(&self.outbox, &self.pool).await?)
    }

    /// The router nested at `path` (`"/outbox"`), ready to [`merge`](Router::merge) into the
    /// application's: as `Router::new().nest(path, self.router())`, plus `path/` (with its
    /// trailing slash, which axum's `nest` does not answer) redirecting to `path`.
    ///
    /// ```no_run
    /// # async fn f(pool: sqlx::PgPool, outbox: outbox::Outbox) -> Result<(), outbox_ui::UiError> {
    /// let app: axum::Router = axum::Router::new()
    ///     // .route("/", …) the application's own routes
    ///     .merge(outbox_ui::Dashboard::new(outbox, pool)?.router_at("/outbox")?);
    /// # let _ = app;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`UiError::InvalidSetting`] when `path` does not start with `/`, ends with `/` or is
    /// `/` itself (serve [`Dashboard::router`] at the root instead).
    pub fn router_at(self, path: &str) -> Result<Router, UiError> {
        if !path.starts_with('/') || path.ends_with('/') || path.contains(['{', '}', '*']) {
            return Err(UiError::InvalidSetting {
                field: "router_at",
                reason: format!(
                    "the mount {path:?} must start with / and not end with one (not / itself), without {{, }} or *"
                ),
            });
        }
        let to = path.to_owned();
        Ok(Router::new().nest(path, self.router()).route(
            &format!("{path}/"),
            get(move || async move { axum::response::Redirect::permanent(&to) }),
        ))
    }

    /// The router: every page, action and embedded asset, with paths relative to where it
    /// is nested (links are built from the request's original path, so `nest("/outbox",
    /// …)` and serving it at `/` both work).
    pub fn router(self) -> Router {
        let state: State = Arc::new(Inner::new(
            self.outbox,
            self.pool,
            self.read_only,
            self.lease_ttl,
            self.page_size,
        ));
        Router::new()
            .route("/", get(pages::queues::page))
            .route("/queue", get(pages::queue::by_name))
            .route("/queue/pause", actions::on_named_queue(QueueOp::Pause))
            .route("/queue/resume", actions::on_named_queue(QueueOp::Resume))
            .route("/queue/cancel", actions::on_named_queue(QueueOp::Cancel))
            .route("/queues/{queue}", get(pages::queue::page))
            .route("/rows/{id}", get(pages::row::page))
            .route("/rows/{id}/download/{what}", get(download::row))
            .route("/dead-letters", get(pages::dead_letters::page))
            .route(
                "/dead-letters/{id}/download/{what}",
                get(download::dead_letter),
            )
            .route("/schedules", get(pages::schedules::page))
            .route("/schema", get(pages::schema::page))
            .route("/assets/app.css", get(layout::css))
            .route("/assets/app.js", get(layout::js))
            .route("/queues/{queue}/pause", actions::on_queue(QueueOp::Pause))
            .route("/queues/{queue}/resume", actions::on_queue(QueueOp::Resume))
            .route("/queues/{queue}/cancel", actions::on_queue(QueueOp::Cancel))
            .route("/rows/{id}/run-now", actions::on_row(Some(RowOp::RunNow)))
            .route("/rows/{id}/reschedule", actions::on_row(None))
            .route("/rows/{id}/delete", actions::on_row(Some(RowOp::Delete)))
            .route("/dead-letters/redrive", post(actions::redrive))
            .route("/dead-letters/purge", post(actions::purge))
            .fallback(|| async { axum::http::StatusCode::NOT_FOUND })
            .layer(axum::middleware::from_fn(guard::text_only))
            .layer(axum::middleware::from_fn_with_state(
                state.clone(),
                layout::plain_errors,
            ))
            .layer(axum::middleware::from_fn(guard::headers))
            .with_state(state)
    }
}

// The crate's README (crates.io's page): its Rust block is a doc test too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

// The guide's dashboard page: its Rust blocks are doc tests of this crate (cfg(doctest)
// only, so a packaged build never reads a file outside the crate).
#[cfg(doctest)]
#[doc = include_str!("../../docs/guide/dashboard.md")]
struct GuideDashboardDoctests;
