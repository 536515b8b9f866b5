//! The `#[timer]` attribute of the [`outbox`](https://docs.rs/outbox) crate.
//!
//! Use it through the runtime crate, as `#[outbox::timer(...)]`; this crate is an
//! implementation detail and its version always matches `outbox`'s exactly.
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//!
//! #[outbox::timer(queue = "presence.expiry", max_deliveries = 5)]
//! #[derive(Debug, serde::Serialize, serde::Deserialize)]
//! pub struct PresenceExpiry {
//!     pub user_id: i64,
//! }
//!
//! async fn on_ping(pool: &sqlx::PgPool, user_id: i64) -> Result<(), outbox::Error> {
//!     let mut tx = pool.begin().await?;
//!     // ... the request's own writes on `tx` ...
//!     // Every ping moves the user's expiry 60 s past the database's `now()`; a ping that
//!     // lands while the expiry handler runs queues a rearm instead of being lost.
//!     extend_presence_expiry(&mut *tx, &user_id.to_string(), &PresenceExpiry { user_id }, Duration::from_secs(60))
//!         .await?;
//!     tx.commit().await?;
//!     Ok(())
//! }
//!
//! async fn on_logout(pool: &sqlx::PgPool, user_id: i64) -> Result<(), outbox::Error> {
//!     let mut conn = pool.acquire().await?;
//!     cancel_presence_expiry(&mut *conn, &user_id.to_string()).await?;
//!     Ok(())
//! }
//! ```
//!
//! # What it generates
//!
//! The struct stays exactly as written. Next to it, the attribute adds the code below;
//! writing it by hand is equivalent (the macro is sugar over public API):
//!
//! ```no_run
//! # #[derive(Debug, serde::Serialize, serde::Deserialize)]
//! # pub struct PresenceExpiry { pub user_id: i64 }
//! impl outbox::Timer for PresenceExpiry {
//!     const QUEUE: &'static str = "presence.expiry";
//!     const MAX_DELIVERIES: u32 = 5;
//! }
//!
//! /// Schedules the timer; if a live timer holds the key, nothing changes (`Skipped`).
//! pub async fn publish_presence_expiry(
//!     conn: impl outbox::Publisher,
//!     timer_id: &str,
//!     payload: &PresenceExpiry,
//!     schedule: impl Into<outbox::message::Schedule>,
//! ) -> Result<outbox::Published, outbox::Error> {
//!     outbox::message::publish_timer::<PresenceExpiry>(conn, timer_id, payload, schedule).await
//! }
//!
//! /// Schedules the timer or moves it later: `Inserted`, `Extended`, `RearmQueued` (its
//! /// handler is running) or `Unchanged`.
//! pub async fn extend_presence_expiry(
//!     conn: impl outbox::Publisher,
//!     timer_id: &str,
//!     payload: &PresenceExpiry,
//!     schedule: impl Into<outbox::message::Schedule>,
//! ) -> Result<outbox::Published, outbox::Error> {
//!     outbox::message::extend_timer::<PresenceExpiry>(conn, timer_id, payload, schedule).await
//! }
//!
//! /// Cancels the timer: `Deleted`, `RearmDropped`, `Running` or `NotFound`.
//! pub async fn cancel_presence_expiry(
//!     conn: impl outbox::Publisher,
//!     timer_id: &str,
//! ) -> Result<outbox::Cancelled, outbox::Error> {
//!     outbox::message::cancel_timer::<PresenceExpiry>(conn, timer_id).await
//! }
//! ```
//!
//! The real expansion differs only in hygiene: it names everything by absolute paths
//! (`::outbox::…`, and `::outbox::__private::Result` for `Result`, `Into`, `str`, …), so a
//! `Result` alias or any other name in your module cannot change its meaning, and the
//! code compiles under `#![deny(unused_qualifications)]`; its parameters are called
//! `__conn`, `__timer_id`, `__payload` and `__schedule`, so they cannot collide with your
//! names; the impl sits inside `const _: () = { … };` and its
//! header is spanned at the struct's name, so a payload that is not `Serialize`,
//! `DeserializeOwned`, `Send` or `Sync` is reported once, at the struct. Each function
//! carries a doc comment (with an
//! `# Errors` section), so it passes `#![deny(missing_docs)]`.
//!
//! - `publish_<snake>`, `extend_<snake>`, `extend_<snake>_with_slack` and `cancel_<snake>`
//!   are named after the struct
//!   in snake case (`PresenceExpiry` → `presence_expiry`) and have the struct's
//!   visibility (`pub`, `pub(crate)`, private, …). They return
//!   [`Published`](https://docs.rs/outbox/latest/outbox/enum.Published.html) (publish and
//!   extend) and [`Cancelled`](https://docs.rs/outbox/latest/outbox/enum.Cancelled.html)
//!   (cancel).
//! - `conn` is anything implementing `outbox::Publisher`, passed by value: `&mut *tx` for
//!   a `sqlx::Transaction` (or `&mut tx`), `&mut *conn` for a connection from
//!   `pool.acquire()`, `&pool` (a `&PgPool`: autocommit, so not in your transaction), all
//!   into the tables of `Outbox::global()`; `outbox.on(&mut *tx)` for an `Outbox` with its
//!   own table names; `&store` for a `PgStore` or the in-memory `MemoryStore`. Anything
//!   else is a compile error that lists these forms. The library never begins, commits or
//!   rolls back your transaction.
//! - `schedule` is a `std::time::Duration` (relative to the **database** clock), a
//!   `chrono::DateTime<Utc>` or `SystemTime` (absolute), or `outbox::message::Schedule::now()`.
//! - Handlers are registered on a worker by type (`T: outbox::Timer`), which is all the
//!   worker needs from the macro: the queue comes from `T::QUEUE`, the payload is decoded
//!   as JSON into `T` (a payload that does not decode is the runtime's terminal
//!   `decode_error`, never a retry loop), and a handler taking another payload type does
//!   not compile.
//!
//! # Arguments
//!
//! | argument | required | value |
//! |---|---|---|
//! | `queue = "..."` | yes | the queue's name: 1..=255 bytes of ASCII letters, digits, `.`, `_`, `:` and `-` (the runtime accepts any 1..=255 bytes without NUL; the macro keeps names safe for metric labels, logs and shells) |
//! | `max_deliveries = N` | yes | an integer literal from 1 to `u32::MAX`: how many claims a row may have: a claim that brings its `deliveries_count` past `N` is a terminal failure with reason `max_deliveries`, and the handler does not run. Counts reclaims after lost leases too, so it also stops a handler that crashes its worker every time |
//! | `every = "..."` | no | a schedule of the type: a run every interval of real time, as the `humantime` crate reads it (`"30s"`, `"5m"`, `"1h 30m"`, `"2days"`; no months or years; above zero, at most 10 000 years of 366 days, whole microseconds) |
//! | `cron = "..."` | no (cargo feature `cron` of `outbox`) | a schedule of the type: a cron expression of 5 fields (`minute hour day-of-month month day-of-week`) or 6 (a leading `second`), as the `croner` crate reads it, at most 256 bytes, that matches at least one instant |
//! | `tz = "..."` | no, only with `cron` | the IANA time zone the `cron` expression's wall clock is read in (`"Europe/Berlin"`), from the `chrono-tz` database, case-sensitive. Default `"UTC"` |
//! | `crate = "path"` | no | where the runtime crate is, for crates that re-export `outbox` or rename the dependency: `crate = "my_lib::outbox"`. Default `::outbox` |
//!
//! # Schedules
//!
//! `every` or `cron` (with `tz`) makes the type a **periodic timer**: every worker that
//! handles the type registers the schedule when it starts, as the keyed timer
//! `schedule:default` in the type's queue (`outbox::periodic::DECLARED_SCHEDULE_NAME`), and
//! each run gets `T::default()` as its payload, so the struct must implement `Default`
//! (a compile error at the schedule string otherwise). Registration is one statement that
//! leaves exactly one live row however many workers start at once, so no leader is needed;
//! when a run starts, the next instant is queued on the row, so a failed, dead-lettered or
//! crashed run keeps the schedule. The runtime docs (`outbox::periodic`,
//! `WorkerBuilder::schedule`) give the rules: which instants fire across daylight-saving
//! changes, missed instants, changing and cancelling a schedule. Several schedules of one
//! type, or a payload that is not `Default`, are registered on the worker with
//! `WorkerBuilder::schedule(name, recurrence, payload)` instead.
//!
//! ```no_run
//! #[outbox::timer(queue = "maintenance.cleanup", max_deliveries = 3, every = "5m")]
//! #[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
//! pub struct Cleanup {}
//! ```
//!
//! With the `cron` feature (`outbox = { version = "0.1", features = ["cron"] }`):
//!
//! ```ignore
//! // Every day at 06:00 Berlin time (05:00 UTC in winter, 04:00 UTC in summer).
//! #[outbox::timer(queue = "reports.daily", max_deliveries = 3, cron = "0 0 6 * * *", tz = "Europe/Berlin")]
//! #[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
//! pub struct DailyReport {}
//! ```
//!
//! The attribute then also generates, inside the `Timer` impl:
//!
//! ```ignore
//! fn declared_schedule() -> Option<(outbox::Result<outbox::periodic::Recurrence>, Self)> {
//!     Some((outbox::periodic::Recurrence::parse_every("5m"), Self::default()))
//! }
//! ```
//!
//! Retry strategy and lease length are not arguments: they are chosen where a handler is
//! registered on a worker, so the same payload type can be served with different settings
//! by different deployments, and the struct stays a plain data type.
//!
//! # Errors at compile time
//!
//! Every problem is reported at once, each at the token that causes it: a missing `queue`
//! or `max_deliveries` (at the attribute); an empty, over-long (more than 255 bytes) or
//! badly charactered queue; `max_deliveries` that is zero, negative, not an integer or
//! larger than `u32::MAX`; an unknown argument (the message lists the allowed ones); a
//! duplicate argument; an `every` that is not a duration, is zero or is over 10 000
//! years; a `cron` expression that does not parse, is over 256 bytes or never matches; an
//! unknown `tz`; both `every` and `cron`; `tz` without `cron` or with `every`; `cron`
//! without the `cron` feature (the message names it); a scheduled payload without
//! `Default`; the attribute on an enum, a union, a generic struct or anything
//! that is not a struct; and a payload that is not `Serialize` + `DeserializeOwned`
//! (reported at the struct's name). The struct is always emitted, and when the struct
//! itself is fine the impl and functions are too (with placeholder values), so a mistake
//! in the attribute shows as one error, not as a cascade of "cannot find function" and
//! "trait not implemented" errors wherever the type is used.
//!
//! `Timer` also requires `Send + Sync + 'static`: a payload holding an `Rc` or a
//! reference does not compile.
//!
//! Put `#[outbox::timer]` on a struct that derives (or implements) `serde::Serialize` and
//! `serde::Deserialize`; serde's own attributes (`rename_all`, `default`, …) work as usual
//! and change the stored JSON accordingly.

mod args;
mod errors;
mod expand;
mod from_ref;
mod model;
mod schedule;
mod validate;

use proc_macro::TokenStream;
use quote::quote;

use crate::errors::Errors;
use crate::validate::Checked;

/// Derives `outbox::FromRef<Self>` for the type of each field of a state struct, so a
/// handler of a worker given this state ([`WorkerBuilder::state`]) can ask its context for
/// a field by type: `ctx.state::<PgPool>()`; asking for a type the state does not provide
/// does not compile. Each field's type must be `Clone` (keep them cheap: pools, `Arc`s).
///
/// ```
/// #[derive(Clone, outbox::FromRef)]
/// struct AppState {
///     db: sqlx::PgPool,
///     name: std::sync::Arc<str>,
///     #[from_ref(skip)]
///     other_name: std::sync::Arc<str>,
/// }
/// ```
///
/// `#[from_ref(skip)]` leaves a field out (two fields of one type are refused: a handler
/// asking for that type would be ambiguous; skip all but one, or wrap one in a type of its
/// own); `#[from_ref(crate =
/// "path")]` on the struct names the runtime when `outbox` is re-exported or renamed.
/// Generic structs are refused; implement `FromRef` by hand for those.
///
/// [`WorkerBuilder::state`]: https://docs.rs/outbox/latest/outbox/struct.WorkerBuilder.html#method.state
#[proc_macro_derive(FromRef, attributes(from_ref))]
pub fn derive_from_ref(input: TokenStream) -> TokenStream {
    from_ref::derive(input.into()).into()
}

/// Turns a payload struct into a typed timer.
///
/// ```
/// use outbox::Timer;
///
/// #[outbox::timer(queue = "presence.expiry", max_deliveries = 5)]
/// #[derive(serde::Serialize, serde::Deserialize)]
/// pub struct PresenceExpiry { pub user_id: i64 }
///
/// assert_eq!(PresenceExpiry::QUEUE, "presence.expiry");
/// assert_eq!(PresenceExpiry::MAX_DELIVERIES, 5);
/// // `publish_presence_expiry`, `extend_presence_expiry` and `cancel_presence_expiry` exist.
/// async fn logout(pool: &sqlx::PgPool) -> Result<(), outbox::Error> {
///     cancel_presence_expiry(pool, "42").await?;
///     Ok(())
/// }
/// ```
///
/// Keeps the struct as written and generates, with the struct's visibility:
/// - `impl outbox::Timer for PresenceExpiry` carrying `QUEUE` and `MAX_DELIVERIES`;
/// - `publish_presence_expiry(conn, timer_id, &payload, schedule)`: schedules the timer,
///   or changes nothing (`Published::Skipped`) when a live timer holds the key;
/// - `extend_presence_expiry(conn, timer_id, &payload, schedule)`: schedules the timer or
///   moves it later (`Inserted`, `Extended`, `Unchanged`), and queues a rearm when its
///   handler is running (`RearmQueued`);
/// - `extend_presence_expiry_with_slack(conn, timer_id, &payload, schedule, slack)`: the
///   same, but a move of a waiting timer (or of a queued rearm) by `slack` (a `Duration`)
///   or less writes nothing (`Unchanged`); the timer may then fire up to `slack` early, so
///   its handler re-checks and extends it again to the real deadline;
/// - `cancel_presence_expiry(conn, timer_id)`: `Deleted`, `RearmDropped`, `Running` or
///   `NotFound`.
///
/// `conn` is `&mut *tx` (a sqlx transaction), `&mut *conn` (a pooled connection), `&pool`
/// (autocommit), `outbox.on(&mut *tx)` or `&store`; `schedule` a `Duration` (database
/// clock), an absolute time or `Schedule::now()`.
///
/// Arguments: `queue = "..."` (required; 1..=255 bytes of `[A-Za-z0-9._:-]`),
/// `max_deliveries = N` (required; 1..=`u32::MAX` claims before a terminal failure),
/// `every = "5m"` or `cron = "0 0 6 * * *"` with `tz = "Europe/Berlin"` (optional, `cron`
/// needs the cargo feature `cron`; a schedule registered as `schedule:default` by every
/// worker handling the type, each run with `Self::default()` as its payload) and
/// `crate = "path"` (optional; where the runtime is when `outbox` is re-exported or
/// renamed). Mistakes are compile errors at the offending token, all reported at once.
///
/// The [`outbox-macros` crate docs](https://docs.rs/outbox-macros) show the equivalent
/// hand-written code and every compile-time check.
#[proc_macro_attribute]
pub fn timer(args: TokenStream, item: TokenStream) -> TokenStream {
    timer_impl(args.into(), item.into()).into()
}

fn timer_impl(
    args: proc_macro2::TokenStream,
    item: proc_macro2::TokenStream,
) -> proc_macro2::TokenStream {
    let mut errors = Errors::default();
    let parsed = args::Args::parse(args, &mut errors);
    let item_ast: syn::Item = match syn::parse2(item.clone()) {
        Ok(item) => item,
        Err(err) => {
            // Not an item we can read: give it back untouched so rustc reports its own
            // syntax errors, plus ours.
            errors.push(err);
            let errors = errors.into_compile_errors();
            return quote!(#item #errors);
        }
    };
    match validate::check(parsed, &item_ast, &mut errors) {
        Checked::Valid(model) => {
            let expansion = expand::expand(&model);
            quote!(#item #expansion)
        }
        Checked::Invalid(stand_in) => {
            let stand_in = stand_in.as_ref().map(expand::expand);
            let errors = errors.into_compile_errors();
            quote!(#item #errors #stand_in)
        }
    }
}
