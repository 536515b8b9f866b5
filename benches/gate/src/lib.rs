//! The benchmark gate of SPEC §12, as a library: the throwaway Postgres cluster, the
//! scenarios and how each is measured, the report, the committed baseline and the gate's
//! comparison. The binary `outbox-bench` (`run`, `check`) is what CI runs; the lab
//! (`benches/lab`, binary `outbox-lab`) builds its longer runs on the same pieces.
//!
//! ```text
//! cluster     a private cluster with pg_stat_statements, removed on drop
//! replica     a streaming standby of it; promote, stop, move to another port
//! probe       the server's counters: statements, WAL, tuples
//! recorder    the worker's metrics, read while a scenario runs
//! payload     the benchmark's message type (`#[outbox::timer]`)
//! pgbouncer   a PgBouncer in transaction mode with the deployment guide's settings
//! scenarios   the scenarios and one run of each
//! report      printing, the baseline file, the gate's comparison
//! session     the server a run measures (a throwaway cluster or --dsn) and its connection
//! run         `run` and `check`: the scenarios, repeated, their medians, the summary
//! ```
//!
//! Without `--dsn` a run starts a throwaway Postgres cluster with `pg_stat_statements`
//! preloaded (see [`cluster`]) and removes it afterwards. The figures, which of them are
//! gated, and how to read them are in `docs/performance.md`.

pub mod cluster;
pub mod payload;
pub mod pgbouncer;
pub mod probe;
pub mod recorder;
pub mod replica;
pub mod report;
pub mod run;
pub mod scenarios;
pub mod session;

/// The error every fallible step of a run returns: it is printed and the process exits 2.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
