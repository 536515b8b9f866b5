//! The command line: global options and subcommands (clap derive).

use std::time::Duration;

use chrono::{DateTime, Utc};
use clap::{Args, Parser, Subcommand};

/// Operate outbox queues on Postgres: migrate and check the schema, watch queue statistics,
/// pause and resume queues, list pending rows, and list, redrive or purge dead letters.
///
/// Every command connects to the database of `--database-url` (or `DATABASE_URL`) and works
/// on the tables of `--schema` and `--table` (the application's `Outbox` settings).
#[derive(Debug, Parser)]
#[command(
    name = "outbox",
    version,
    propagate_version = true,
    after_help = "Exit status: 0 on success; 1 on a failure, schema problems (validate) or rows \
                  left undone (run-now, reschedule, delete, cancel, dlq redrive); 2 on a usage error (a \
                  bad option or value, a missing or non-Postgres URL, a queue name, id or time \
                  range the library refuses). With --json an error is one JSON object on \
                  stderr: {\"error\": \"...\", \"exit_code\": N}."
)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// Options every command takes.
#[derive(Debug, Args)]
pub struct Global {
    /// Postgres connection URL, e.g. postgres://user@host:5432/db [default: the environment
    /// variable DATABASE_URL].
    // Read from the environment in `main`, not with clap's `env`: clap counts a value from
    // the environment as given and repeats `--database-url <DATABASE_URL>` in every usage
    // line of an error (found by a fresh-user trial).
    #[arg(long, global = true)]
    pub database_url: Option<String>,
    /// Schema of the outbox's tables (default: the connection's search_path).
    #[arg(long, global = true)]
    pub schema: Option<String>,
    /// The queue table (the dead-letter table is `<table>_dlq`).
    #[arg(long, global = true, default_value = "outbox")]
    pub table: String,
    /// The dead-letter table, when it is not `<table>_dlq`.
    #[arg(long, global = true)]
    pub dead_letter_table: Option<String>,
    /// The application archives terminal failures to the dead-letter table
    /// (`OutboxBuilder::dead_letter(true)`): `migrate` and `validate` then cover that table's
    /// upgrades too, and `status` counts dead letters. Off by default, as in the library.
    /// The `dlq` commands always work with the dead-letter table.
    #[arg(long, global = true)]
    pub dead_letter: bool,
    /// The database URL reaches Postgres through a pooler in transaction mode (PgBouncer
    /// `pool_mode = transaction`): every statement is sent unnamed and inside a
    /// transaction (`OutboxBuilder::transaction_pooler(true)`). `migrate` then refuses:
    /// run it with a URL of the server itself.
    #[arg(long, global = true)]
    pub transaction_pooler: bool,
    /// The outbox is distributed on a Citus cluster with this many buckets
    /// (`OutboxBuilder::distributed`); the database URL names the coordinator. `migrate`
    /// creates the tables distributed; `validate` checks the distribution; the actions by
    /// id name each row's bucket; dead-letter redrive and purge go bucket by bucket. Every
    /// process must use the table's count (1 to 256).
    // 1..=256: the range `OutboxBuilder::distributed` accepts, refused here with clap's
    // message rather than the library's after connecting.
    #[arg(long, global = true, value_name = "BUCKETS",
          value_parser = clap::value_parser!(u16).range(1..=256))]
    pub distributed: Option<u16>,
    /// Print JSON instead of a table (one document per command; one per refresh with
    /// `status --watch`).
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create or upgrade the tables online (safe on a busy database; a no-op when current).
    Migrate {
        /// Longest a DDL step waits for its table lock per try (e.g. 3s).
        #[arg(long, value_parser = duration)]
        lock_timeout: Option<Duration>,
        /// Longest the whole run keeps retrying steps that wait for locks (e.g. 5m).
        #[arg(long, value_parser = duration)]
        deadline: Option<Duration>,
    },
    /// Compare the live schema with what this version needs; list every problem. Exit
    /// status 1 when there is any.
    Validate,
    /// Statistics per queue: pending, due, leased, expired leases, lateness, rearms, cancel
    /// marks, dead letters, paused.
    Status(StatusArgs),
    /// Live rows of a queue (pending and leased), by deadline.
    Pending {
        /// The queue.
        queue: String,
        /// At most this many rows (at least 1).
        #[arg(long, default_value_t = 50, value_parser = at_least_one)]
        limit: u64,
    },
    /// Pause a queue: workers stop claiming it; publishing goes on.
    Pause {
        /// The queue.
        queue: String,
    },
    /// Resume a paused queue and wake its workers.
    Resume {
        /// The queue.
        queue: String,
    },
    /// Cancel the timer keyed TIMER_ID of QUEUE: a pending timer's row is deleted; a running
    /// one's is marked and deleted however its run ends (no retry, no dead letter), and a
    /// rearm an extend queued is dropped. Exit status 1 when no live row holds the key.
    Cancel {
        /// The queue.
        queue: String,
        /// The timer's key.
        timer_id: String,
    },
    /// Make pending row ID due now (its counters and retry history stay). Exit status 1
    /// when a worker holds the row or no live row has the id.
    RunNow {
        /// The row's id (`outbox pending` lists them).
        #[arg(value_parser = row_id)]
        id: i64,
    },
    /// Move the deadline of pending row ID, earlier or later. Exit status 1 when a worker
    /// holds the row or no live row has the id.
    #[command(group(clap::ArgGroup::new("when").required(true).args(["in_", "at"])))]
    Reschedule {
        /// The row's id (`outbox pending` lists them).
        #[arg(value_parser = row_id)]
        id: i64,
        /// Due this long from now (database clock), e.g. 5m.
        #[arg(long = "in", id = "in_", value_name = "DURATION", value_parser = duration)]
        in_: Option<Duration>,
        /// Due at this time (RFC 3339).
        #[arg(long, value_name = "TIME", value_parser = timestamp)]
        at: Option<DateTime<Utc>>,
    },
    /// Delete pending row ID: it will not run. Exit status 1 when a worker holds the row or
    /// no live row has the id.
    Delete {
        /// The row's id (`outbox pending` lists them).
        #[arg(value_parser = row_id)]
        id: i64,
    },
    /// Dead letters: list, redrive, purge.
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// Serve the web dashboard (queues, rows, dead letters, schema; the actions of the other
    /// commands) until interrupted. Binds to 127.0.0.1 unless --listen says otherwise.
    Ui(UiArgs),
}

#[derive(Debug, Args)]
pub struct UiArgs {
    /// The address and port to listen on (`127.0.0.1:8080`, `[::1]:8080`, or a host name
    /// such as `localhost:8080`, resolved, its first address taken); an address other than
    /// a loopback one exposes the dashboard to the network (use --basic-auth, and TLS in
    /// front).
    #[arg(long, default_value = "127.0.0.1:8080", value_name = "HOST:PORT")]
    pub listen: String,
    /// Show only: no action is offered and every POST is refused.
    #[arg(long)]
    pub read_only: bool,
    /// Require HTTP basic authentication with these credentials, written `user:password`.
    #[arg(
        long,
        env = "OUTBOX_UI_BASIC_AUTH",
        hide_env_values = true,
        value_name = "USER:PASSWORD",
        value_parser = Credentials
    )]
    pub basic_auth: Option<(String, String)>,
    /// The lease TTL your workers use (`WorkerBuilder::lease_ttl`, 60 s by default, 100ms to
    /// 7d): a lease older than this is shown as expired.
    #[arg(long, value_parser = duration, default_value = "60s")]
    pub lease_ttl: Duration,
    /// Install the per-queue throughput counter before serving (a table `<table>_finished`
    /// and an AFTER DELETE trigger on the queue table that counts each queue's finished
    /// rows; one small upsert per queue per deleting statement). Idempotent.
    #[arg(long, conflicts_with = "remove_throughput_counter")]
    pub throughput_counter: bool,
    /// Remove the throughput counter (trigger, function, table) before serving.
    #[arg(long)]
    pub remove_throughput_counter: bool,
}

/// `user:password`, both non-empty, the user without a colon.
/// `--basic-auth`'s parser: its error never repeats the value (a password would land in
/// logs), unlike clap's own `invalid value '…'`.
#[derive(Debug, Clone, Copy)]
struct Credentials;

impl clap::builder::TypedValueParser for Credentials {
    type Value = (String, String);

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        _arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<Self::Value, clap::Error> {
        value
            .to_str()
            .ok_or_else(|| "the credentials are not UTF-8".to_owned())
            .and_then(credentials)
            .map_err(|why| {
                clap::Error::raw(
                    clap::error::ErrorKind::ValueValidation,
                    format!("bad --basic-auth (value not shown): {why}\n"),
                )
                .with_cmd(cmd)
            })
    }
}

fn credentials(s: &str) -> Result<(String, String), String> {
    match s.split_once(':') {
        Some((user, password)) if !user.is_empty() && !password.is_empty() => {
            Ok((user.to_owned(), password.to_owned()))
        }
        _ => Err("write the credentials as user:password (both non-empty)".to_owned()),
    }
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The lease TTL your workers use (`WorkerBuilder::lease_ttl`, 60 s by default): a lease
    /// older than this counts as expired.
    #[arg(long, value_parser = duration, default_value = "60s")]
    pub lease_ttl: Duration,
    /// Only these queues (repeat the option); default: every queue with rows or dead letters.
    #[arg(long = "queue")]
    pub queues: Vec<String>,
    /// Planner estimates instead of exact counts (cheap on very large tables).
    #[arg(long)]
    pub estimate: bool,
    /// Refresh every interval (e.g. 5s; at least 100ms) until interrupted; a bare --watch
    /// refreshes every 2s.
    #[arg(long, value_parser = watch_interval, num_args = 0..=1, default_missing_value = "2s")]
    pub watch: Option<Duration>,
}

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// List dead letters, oldest first.
    List {
        #[command(flatten)]
        filter: DlqFilter,
        /// At most this many rows (at least 1).
        #[arg(long, default_value_t = 50, value_parser = at_least_one)]
        limit: u64,
        /// Continue after this dead-letter id (the last id of the previous page).
        #[arg(long)]
        after: Option<i64>,
    },
    /// Send dead letters back to their queue (a row is redriven once; redriving it again
    /// reports it already redriven, which counts as done).
    ///
    /// Prints each dead letter's outcome. Exit status 1 when any was not redriven: no such
    /// dead letter, a live row holds its timer key, or its headers are not a string map or
    /// would grow over the limit.
    #[command(group(clap::ArgGroup::new("which").required(true).args(["ids", "all"])))]
    Redrive {
        /// These dead-letter ids (repeat the option, or separate with commas); not with
        /// --all, --limit or filters.
        #[arg(
            long = "id",
            value_delimiter = ',',
            value_parser = row_id,
            conflicts_with_all = ["all", "limit", "queue", "reason", "since", "until"]
        )]
        ids: Vec<i64>,
        /// Every dead letter matching the filter (up to --limit) that is not redriven yet.
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        filter: RedriveFilter,
        /// With --all: at most this many (at least 1).
        #[arg(long, default_value_t = 1000, value_parser = at_least_one)]
        limit: u64,
    },
    /// Delete dead letters older than an age, in batches.
    Purge {
        /// Delete dead letters that failed longer ago than this (e.g. 30d).
        #[arg(long, value_parser = duration)]
        older_than: Duration,
        /// Only this queue.
        #[arg(long)]
        queue: Option<String>,
        /// Rows per batch (each batch its own short transaction; at least 1).
        #[arg(long, default_value_t = 1000, value_parser = at_least_one)]
        batch_size: u64,
    },
}

/// Which dead letters.
#[derive(Debug, Args, Clone, Default)]
pub struct DlqFilter {
    /// Only this queue.
    #[arg(long)]
    pub queue: Option<String>,
    /// Only this failure reason (max_deliveries, retry_exhausted, rejected, decode_error,
    /// timeout, aborted).
    #[arg(long)]
    pub reason: Option<String>,
    /// Failed at or after this time (RFC 3339, e.g. 2026-11-30T00:00:00Z).
    #[arg(long, value_parser = timestamp)]
    pub since: Option<DateTime<Utc>>,
    /// Failed before this time (RFC 3339).
    #[arg(long, value_parser = timestamp)]
    pub until: Option<DateTime<Utc>>,
    /// Include dead letters already redriven.
    #[arg(long)]
    pub include_redriven: bool,
}

/// Which dead letters a redrive with --all takes (never those already redriven).
#[derive(Debug, Args, Clone, Default)]
pub struct RedriveFilter {
    /// Only this queue.
    #[arg(long)]
    pub queue: Option<String>,
    /// Only this failure reason (max_deliveries, retry_exhausted, rejected, decode_error,
    /// timeout, aborted).
    #[arg(long)]
    pub reason: Option<String>,
    /// Failed at or after this time (RFC 3339, e.g. 2026-11-30T00:00:00Z).
    #[arg(long, value_parser = timestamp)]
    pub since: Option<DateTime<Utc>>,
    /// Failed before this time (RFC 3339).
    #[arg(long, value_parser = timestamp)]
    pub until: Option<DateTime<Utc>>,
}

impl From<RedriveFilter> for DlqFilter {
    fn from(f: RedriveFilter) -> DlqFilter {
        DlqFilter {
            queue: f.queue,
            reason: f.reason,
            since: f.since,
            until: f.until,
            include_redriven: false,
        }
    }
}

/// A count from the command line (at least 1 by its parser) as a `usize`.
pub fn count(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// A `--watch` interval: a duration of at least 100 ms.
fn watch_interval(s: &str) -> Result<Duration, String> {
    let d = duration(s)?;
    if d < Duration::from_millis(100) {
        return Err(format!(
            "{s} is too short: refresh at most every 100ms (a bare --watch means every 2s)"
        ));
    }
    Ok(d)
}

/// A duration such as `500ms`, `30s`, `5m`, `7d`; months and years (`1M`, `1y`) are
/// refused, as the library refuses them (`1M` is a month, one letter from `1m`).
fn duration(s: &str) -> Result<Duration, String> {
    outbox::periodic::parse_interval("duration", s).map_err(|e| match e {
        outbox::Error::InvalidArgument { reason, .. } => {
            format!("{reason} (write e.g. 500ms, 30s, 5m, 7d)")
        }
        other => other.to_string(),
    })
}

/// A count of at least 1 (clap's own range check would say "0 is not in
/// 1..18446744073709551615").
fn at_least_one(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{s:?} is not a whole number of at least 1")),
    }
}

/// A row or dead-letter id: a whole number of at least 1.
fn row_id(s: &str) -> Result<i64, String> {
    match s.parse::<i64>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("{s:?} is not an id (a whole number of at least 1)")),
    }
}

/// An RFC 3339 time.
fn timestamp(s: &str) -> Result<DateTime<Utc>, String> {
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| {
            // A local time without its offset: the one part missing (chrono says only
            // "premature end of input").
            let local = chrono::NaiveDateTime::parse_from_str(s, "%Y-%m-%dT%H:%M:%S%.f")
                .or_else(|_| chrono::NaiveDateTime::parse_from_str(s, "%Y-%m-%d %H:%M:%S%.f"));
            if local.is_ok() {
                format!("{s} has no UTC offset: add Z for UTC or one such as +01:00 (e.g. {s}Z)")
            } else {
                format!("{e} (write an RFC 3339 time, e.g. 2026-11-30T00:00:00Z)")
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn durations_and_times_parse_or_say_how_to_write_them() {
        assert_eq!(duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert!(duration("soon").unwrap_err().contains("write e.g."));
        // A month, one letter from a minute: refused, not read as 30.44 days.
        for calendar in ["1M", "1y", "2months"] {
            let e = duration(calendar).unwrap_err();
            assert!(e.contains("calendar unit"), "{calendar}: {e}");
            // No option of the CLI takes a cron expression (a fresh-user trial was told to
            // give one for `--older-than 1y`).
            assert!(!e.contains("cron"), "{calendar}: {e}");
        }
        assert_eq!(duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(
            timestamp("2026-11-30T01:00:00+01:00").unwrap(),
            DateTime::parse_from_rfc3339("2026-11-30T00:00:00Z").unwrap()
        );
        assert!(timestamp("yesterday").unwrap_err().contains("RFC 3339"));
        assert!(timestamp("2026-12-01T08:00:00")
            .unwrap_err()
            .contains("has no UTC offset: add Z"));
        assert_eq!(at_least_one("5"), Ok(5));
        assert_eq!(row_id("7"), Ok(7));
        for bad in ["0", "-1", "x", ""] {
            let e = at_least_one(bad).unwrap_err();
            assert!(
                e.ends_with("is not a whole number of at least 1"),
                "{bad}: {e}"
            );
            assert!(row_id(bad).unwrap_err().contains("at least 1"), "{bad}");
        }
        assert_eq!(watch_interval("100ms"), Ok(Duration::from_millis(100)));
        assert_eq!(
            credentials("ops:s3:cret"),
            Ok(("ops".to_owned(), "s3:cret".to_owned()))
        );
        assert!(credentials("ops").is_err());
        assert!(credentials(":pw").is_err());
        assert!(watch_interval("10ms")
            .unwrap_err()
            .contains("at most every 100ms"));
    }
}
