//! The server a run measures, and the harness's own connection to it: a throwaway cluster
//! (see [`crate::cluster`]) or the server `--dsn` names, checked for `pg_stat_statements`,
//! described, and wrapped in the [`Env`] the scenarios run in.

use std::path::PathBuf;

use clap::Args;
use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, ConnectOptions};

use crate::cluster::Cluster;
use crate::probe;
use crate::recorder;
use crate::report::Machine;
use crate::scenarios::Env;
use crate::BoxError;

/// The options every run shares: which server, which scenarios, the diagnostics.
#[derive(Args, Debug)]
pub struct Common {
    /// Use this server instead of a throwaway cluster. It must preload pg_stat_statements
    /// and should not be busy with anything else (server-wide WAL counters are read).
    #[arg(long)]
    pub dsn: Option<String>,
    /// The server whose settings the throwaway cluster copies (shared_buffers, fsync,
    /// synchronous_commit, …); ignored when it does not answer.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/postgres")]
    pub mirror: String,
    /// Comma-separated scenario names (default: all for `run`, all with a gated figure for `check`).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// sqlx's `test_before_acquire` on the worker's pool. Off by default, as the `PgStore`
    /// docs recommend; `on` (sqlx's own default: one more round trip per pool checkout,
    /// invisible to pg_stat_statements) is a diagnostic, never for baselines.
    #[arg(long, default_value = "off", value_parser = ["on", "off"])]
    pub pool_ping: String,
    /// sqlx's `test_before_acquire` on the application's pool (publishes, extends, the
    /// caller's transactions). On by default, sqlx's default as an application has it;
    /// `off` is a diagnostic, never for baselines.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub app_pool_ping: String,
    /// Keep the scenario tables afterwards (for inspection).
    #[arg(long)]
    pub keep_tables: bool,
    /// Print every statement of every scenario.
    #[arg(short, long)]
    pub verbose: bool,
    /// Print `pg_waldump --stats=record` for each run (throwaway cluster only).
    #[arg(long)]
    pub waldump: bool,
    /// Extra `name=value` server setting for the throwaway cluster (repeatable), for
    /// diagnostics such as `--pg-set synchronous_commit=off`. Never for baselines.
    #[arg(long, value_name = "NAME=VALUE")]
    pub pg_set: Vec<String>,
    /// Extra storage parameter for each scenario table (repeatable), for diagnostics such
    /// as `--table-set fillfactor=70`. Never for baselines.
    #[arg(long, value_name = "NAME=VALUE")]
    pub table_set: Vec<String>,
    /// Baseline file.
    #[arg(long, default_value = default_baseline())]
    pub baseline: PathBuf,
}

impl Common {
    /// Whether a diagnostic option changes the product or the server from what is shipped
    /// and documented (never for a baseline).
    pub fn diagnostics(&self) -> bool {
        !self.pg_set.is_empty()
            || !self.table_set.is_empty()
            || self.pool_ping != "off"
            || self.app_pool_ping != "on"
    }
}

fn default_baseline() -> &'static str {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../baseline.json")
}

/// The server of one run, connected.
pub struct Session {
    pub env: Env,
    /// The throwaway cluster, when no `--dsn` was given; dropping it removes it.
    pub cluster: Option<Cluster>,
    pub machine: Machine,
    pub dsn: String,
}

impl Session {
    /// Installs the metrics recorder, starts the throwaway cluster (with `pg_set` on top of
    /// the mirrored settings) unless `--dsn` names a server, connects, checks
    /// `pg_stat_statements`, and prints the machine and the pools' settings.
    pub async fn open(common: &Common, pg_set: &[String]) -> Result<Session, BoxError> {
        // Before any worker exists.
        recorder::watch();
        let mut cluster = None;
        let (dsn, server) = match &common.dsn {
            Some(d) => (d.clone(), "given server".to_owned()),
            None => {
                eprintln!("starting a throwaway Postgres cluster with pg_stat_statements …");
                let started = Cluster::start(Some(&common.mirror), pg_set)
                    .await
                    .map_err(|e| {
                        format!(
                            "could not start the throwaway Postgres cluster (docs/performance.md, \
                             \"The throwaway cluster\"): {e}"
                        )
                    })?;
                let c = cluster.insert(started);
                let settings: Vec<String> = c
                    .settings
                    .iter()
                    .filter(|(k, _)| {
                        !matches!(
                            k.as_str(),
                            "listen_addresses" | "port" | "unix_socket_directories"
                        )
                    })
                    .map(|(k, v)| format!("{k}={}", v.trim_matches('\'')))
                    .collect();
                eprintln!("cluster on port {}: {}", c.port(), settings.join(" "));
                let server = if pg_set.is_empty() {
                    "throwaway cluster".to_owned()
                } else {
                    format!("throwaway cluster with {}", pg_set.join(" "))
                };
                (c.dsn(), server)
            }
        };
        let opts: PgConnectOptions = dsn.parse()?;
        let mut probe_conn = opts
            .clone()
            .application_name("outbox-bench-probe")
            .connect()
            .await?;
        if let Err(e) = sqlx::query(AssertSqlSafe(probe::tagged(
            "SELECT 1 FROM pg_stat_statements LIMIT 1",
        )))
        .execute(&mut probe_conn)
        .await
        {
            return Err(format!(
                "pg_stat_statements is not usable on {dsn}: {e} (it needs shared_preload_libraries; omit --dsn for a throwaway cluster)"
            )
            .into());
        }
        let version: String = sqlx::query_scalar("SELECT current_setting('server_version')")
            .fetch_one(&mut probe_conn)
            .await?;
        let machine = Machine::read(&format!("PostgreSQL {version}"), &server);
        println!("{}", machine.describe());
        println!(
            "pools: worker test_before_acquire({}){}, application test_before_acquire({}){}; \
             …/async scenarios: synchronous_commit=off on the worker's and the extending connections",
            common.pool_ping == "on",
            if common.pool_ping == "on" {
                " [diagnostic]"
            } else {
                ""
            },
            common.app_pool_ping == "on",
            if common.app_pool_ping == "on" {
                ""
            } else {
                " [diagnostic]"
            },
        );
        let env = Env {
            opts,
            probe: probe_conn,
            worker_ping: common.pool_ping == "on",
            app_ping: common.app_pool_ping == "on",
            keep_tables: common.keep_tables,
            verbose: common.verbose,
            table_set: common.table_set.clone(),
        };
        Ok(Session {
            env,
            cluster,
            machine,
            dsn,
        })
    }
}
