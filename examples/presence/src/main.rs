//! `presence serve | load | demo`; see the crate docs and README.md.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use outbox::Outbox;
use presence::{load, LoadConfig, Server, ServerConfig, DEFAULT_DATABASE_URL};

/// The outbox presence example: an HTTP presence service whose expiry timers are outbox
/// timers, and a load driver that checks every transition.
///
/// Postgres comes from DATABASE_URL (default postgres://postgres@127.0.0.1:5432/postgres).
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the presence API and run the expiry worker until Ctrl-C.
    Serve(ServeArgs),
    /// Drive a running service over HTTP and check every transition.
    Load {
        /// The service.
        #[arg(long, default_value = "http://127.0.0.1:3000")]
        url: String,
        #[command(flatten)]
        load: LoadArgs,
    },
    /// Serve and drive in one process for a fixed time, print a live summary each second
    /// and a final one; the exit code is non-zero if any transition was wrong.
    Demo {
        /// Keep the rows an earlier demo left in the demo's tables (by default they are
        /// deleted at the start).
        #[arg(long)]
        keep: bool,
        #[command(flatten)]
        serve: ServeArgs,
        #[command(flatten)]
        load: LoadArgs,
    },
}

#[derive(Args, Debug, Clone)]
struct ServeArgs {
    /// HTTP address (`demo` picks a free port when this is left at its default).
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// Seconds a user stays online after the last ping (default: 30 for serve, 5 for demo).
    #[arg(long)]
    timeout_secs: Option<f64>,
    /// Simulated work in the expiry handler, milliseconds (default: 0 for serve, 50 for
    /// demo, so pings land while it runs).
    #[arg(long)]
    handler_delay_ms: Option<u64>,
    /// Expiry handlers running at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Slack of a ping's extend, milliseconds: a ping that would move the waiting timer
    /// by this much or less writes nothing to it, and the expiry handler re-arms a timer
    /// that fired early; 0 writes on every ping (default: 40 % of the timeout, so a user
    /// who pings at least every 60 % of the timeout never makes the timer fire early).
    #[arg(long)]
    slack_ms: Option<u64>,
    /// The worker's ack_batch_size (completions per statement; 1 = one per run).
    #[arg(long, default_value_t = 1)]
    ack_batch_size: usize,
    /// Ping each connection as it leaves the pools (one more round trip per request).
    #[arg(long)]
    test_before_acquire: bool,
    /// `synchronous_commit = off` for the requests' connections: a ping's commit does not
    /// wait for the WAL flush (a database crash may forget the last acknowledged pings).
    #[arg(long)]
    async_commit: bool,
    /// Connections for requests and handlers.
    #[arg(long, default_value_t = 16)]
    pool_size: u32,
    /// Outbox queue table; its dead-letter table is `<table>_dlq` (default: `outbox` for
    /// serve, `presence_demo_outbox` for demo).
    #[arg(long)]
    table: Option<String>,
    /// Users table (default: `presence_users` for serve, `presence_demo_users` for demo).
    #[arg(long)]
    users_table: Option<String>,
    /// `DATABASE_URL` names a Citus coordinator: the outbox in distributed mode with this
    /// many buckets (`OutboxBuilder::distributed`), the users table distributed by the
    /// same bucket and co-located with it, so a ping commits on one node.
    #[arg(long, num_args = 0..=1, default_missing_value = "32", value_name = "BUCKETS")]
    citus: Option<u16>,
}

#[derive(Args, Debug, Clone)]
struct LoadArgs {
    /// Simulated users.
    #[arg(long, default_value_t = 2000)]
    users: usize,
    /// How long users ping, at least 2 × (timeout + allowed lateness + 1 s) (default: 90 for
    /// load, which fits the 30 s timeout of serve; 30 for demo); the final check follows.
    #[arg(long)]
    seconds: Option<f64>,
    /// Share of users whose pings land while the expiry handler runs, then go silent.
    #[arg(long, default_value_t = 0.15)]
    edge: f64,
    /// Share of users who go silent for good.
    #[arg(long, default_value_t = 0.125)]
    silent: f64,
    /// Share of users who log out.
    #[arg(long, default_value_t = 0.125)]
    logout: f64,
    /// Random reads per second that check users during the run.
    #[arg(long, default_value_t = 200)]
    observe_per_sec: u32,
    /// How late past last ping + timeout a user may still be read online, milliseconds.
    #[arg(long, default_value_t = 1000)]
    allowed_lateness_ms: u64,
    /// First user id (default: random, so runs do not share users).
    #[arg(long)]
    first_user_id: Option<i64>,
    /// Seed of the users' random choices (default: random; printed at the end).
    #[arg(long)]
    seed: Option<u64>,
    /// Turn off the logout users who ping while their expiry handler runs and log out
    /// right after (so the cancel drops a queued rearm while the run completes).
    #[arg(long)]
    no_logout_after_rearm: bool,
}

impl LoadArgs {
    fn config(&self, url: String, default_seconds: f64) -> Result<LoadConfig, String> {
        let mut c = LoadConfig::new(url);
        c.users = self.users;
        c.duration = secs(self.seconds.unwrap_or(default_seconds), "--seconds")?;
        c.edge = self.edge;
        c.silent = self.silent;
        c.logout = self.logout;
        c.observe_per_sec = self.observe_per_sec;
        c.allowed_lateness = Duration::from_millis(self.allowed_lateness_ms);
        if let Some(id) = self.first_user_id {
            c.first_user_id = id;
        }
        if let Some(seed) = self.seed {
            c.seed = seed;
        }
        c.logout_after_rearm = !self.no_logout_after_rearm;
        Ok(c)
    }
}

fn secs(v: f64, flag: &str) -> Result<Duration, String> {
    Duration::try_from_secs_f64(v)
        .map_err(|_| format!("{flag} {v}: expected a non-negative number of seconds"))
}

struct ServeDefaults {
    timeout_secs: f64,
    handler_delay_ms: u64,
    table: &'static str,
    users_table: &'static str,
}

const SERVE: ServeDefaults = ServeDefaults {
    timeout_secs: 30.0,
    handler_delay_ms: 0,
    table: outbox::schema::DEFAULT_TABLE,
    users_table: presence::server::DEFAULT_USERS_TABLE,
};

/// The demo has tables of its own, emptied at its start, so timers left by an earlier
/// (interrupted) run cannot fire into this one.
const DEMO: ServeDefaults = ServeDefaults {
    timeout_secs: 5.0,
    handler_delay_ms: 50,
    table: "presence_demo_outbox",
    users_table: "presence_demo_users",
};

impl ServeArgs {
    fn config(&self, defaults: ServeDefaults) -> Result<ServerConfig, String> {
        let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned());
        let mut c = ServerConfig::new(url);
        c.listen = self.listen;
        c.timeout = secs(
            self.timeout_secs.unwrap_or(defaults.timeout_secs),
            "--timeout-secs",
        )?;
        c.handler_delay =
            Duration::from_millis(self.handler_delay_ms.unwrap_or(defaults.handler_delay_ms));
        c.concurrency = self.concurrency;
        c.slack = match self.slack_ms {
            Some(ms) => Duration::from_millis(ms),
            None => c.timeout.mul_f64(0.4),
        };
        c.ack_batch_size = self.ack_batch_size;
        c.test_before_acquire = self.test_before_acquire;
        c.async_commit = self.async_commit;
        c.pool_size = self.pool_size;
        let builder = Outbox::builder().table(self.table.as_deref().unwrap_or(defaults.table));
        let builder = match self.citus {
            Some(buckets) => builder.distributed(buckets),
            None => builder,
        };
        c.outbox = builder.build().map_err(|e| e.to_string())?;
        c.users_table = self
            .users_table
            .as_deref()
            .unwrap_or(defaults.users_table)
            .to_owned();
        Ok(c)
    }
}

/// Exit codes: 0 success, 1 a run with wrong transitions or failed checks, 2 could not start.
fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        // Colours only for a terminal: a redirected log stays plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("presence: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(cli.command)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("presence: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(command: Command) -> Result<bool, String> {
    match command {
        Command::Serve(args) => {
            let config = args.config(SERVE)?;
            let server = Server::start(config.clone())
                .await
                .map_err(|e| e.to_string())?;
            println!(
                "presence: serving on {} (timeout {:?}, timers in {}, users in {}); Ctrl-C stops",
                server.url(),
                config.timeout,
                config.outbox.table(),
                config.users_table
            );
            let _ = tokio::signal::ctrl_c().await;
            let report = server.shutdown().await;
            println!("presence: stopped (graceful: {})", report.graceful);
            Ok(true)
        }
        Command::Load { url, load } => {
            let config = load.config(url, 90.0)?;
            let report = load::run(config).await.map_err(|e| e.to_string())?;
            print!("{}", report.summary());
            Ok(report.ok())
        }
        Command::Demo { keep, serve, load } => {
            let mut config = serve.config(DEMO)?;
            config.reset = !keep;
            if serve.listen == SocketAddr::from(([127, 0, 0, 1], 3000)) {
                // Any free port: the demo talks to itself.
                config.listen = SocketAddr::from(([127, 0, 0, 1], 0));
            }
            // Check the load settings before starting anything.
            load.config(String::new(), 30.0)?
                .validate()
                .map_err(|e| e.to_string())?;
            let server = Server::start(config.clone())
                .await
                .map_err(|e| e.to_string())?;
            let load = load.config(server.url(), 30.0)?;
            println!(
                "presence demo: serving on {}, {} users for {:.0} s, timeout {:?}, slack {:?}, handler delay {:?}, ack batch {}, timers in {}, users in {}",
                server.url(),
                load.users,
                load.duration.as_secs_f64(),
                config.timeout,
                config.slack,
                config.handler_delay,
                config.ack_batch_size,
                config.outbox.table(),
                config.users_table
            );
            let (first, users) = (load.first_user_id, load.users as i64);
            let report = match load::run(load).await {
                Ok(r) => r,
                Err(e) => {
                    server.shutdown().await;
                    return Err(e.to_string());
                }
            };
            let audit = server.audit(first, users).await;
            server.shutdown().await;
            print!("{}", report.summary());
            let audit_ok = match audit {
                Ok(a) => {
                    println!(
                        "  timer rows       online users without a live timer: {}; logged-out users with a timer: {}",
                        a.online_without_timer.len(),
                        a.logged_out_with_timer.len()
                    );
                    a.online_without_timer.is_empty() && a.logged_out_with_timer.is_empty()
                }
                Err(e) => {
                    println!("  timer rows       could not be read: {e}");
                    false
                }
            };
            let ok = report.ok() && audit_ok;
            println!("  overall          {}", if ok { "OK" } else { "FAILED" });
            Ok(ok)
        }
    }
}
