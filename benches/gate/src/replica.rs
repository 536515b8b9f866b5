//! A streaming standby of a throwaway [`Cluster`], and what a failover does to it: the
//! standby tests (`tests/integration/tests/it/postgres/standby/`) and the fault matrix's
//! `failover` (`benches/lab/src/faults.rs`) use it.
//!
//! [`Cluster::standby`] copies the primary with `pg_basebackup -R -X stream` (which writes
//! `primary_conninfo` and `standby.signal`) into a directory of its own and starts it on a
//! free port as a hot standby: it answers reads and refuses every write, and `LISTEN`,
//! with SQLSTATE 25006. The standby is a [`Cluster`] like the primary: dropped = stopped and
//! deleted. [`Cluster::promote`] ends its recovery (`pg_ctl promote`); [`Cluster::stop`]
//! stops a server (the primary "going away"); [`Cluster::move_to_port`] restarts a server on
//! another port, as a failover that moves the primary's address to the promoted standby
//! does.

use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::ConnectOptions;

use crate::cluster::{chown_postgres, free_port, make_dir, Cluster};
use crate::BoxError;

impl Cluster {
    /// Starts a streaming standby of this (running) cluster and waits until it accepts
    /// connections. Blocking in parts (`pg_basebackup`, `pg_ctl`): call it from a runtime
    /// that may block a thread for a few seconds.
    pub async fn standby(&self) -> Result<Cluster, BoxError> {
        let dir = make_dir(self.as_postgres)?;
        let port = free_port()?;
        // From here on, Drop cleans up whatever exists.
        let mut standby = Cluster {
            dir,
            bin: self.bin.clone(),
            port,
            as_postgres: self.as_postgres,
            settings: self.settings.clone(),
            version: self.version.clone(),
        };
        let data = standby.data();
        standby.pg_tool(
            "pg_basebackup",
            &[
                "-D".to_owned(),
                data.display().to_string(),
                "-h".to_owned(),
                "127.0.0.1".to_owned(),
                "-p".to_owned(),
                self.port.to_string(),
                "-U".to_owned(),
                "postgres".to_owned(),
                // Writes standby.signal and primary_conninfo (postgresql.auto.conf).
                "-R".to_owned(),
                "-X".to_owned(),
                "stream".to_owned(),
                "-c".to_owned(),
                "fast".to_owned(),
                "--no-sync".to_owned(),
            ],
        )?;
        // The copied postgresql.conf names the primary's port and socket directory; the
        // lines appended last win.
        let conf = data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf)?;
        text.push_str(&format!(
            "\n# outbox-bench standby\nport = {port}\nunix_socket_directories = '{}'\nhot_standby = on\n",
            standby.dir.display()
        ));
        std::fs::write(&conf, text)?;
        standby.port = port;
        standby.start_server()?;
        standby.settings.retain(|(k, _)| k != "port");
        standby.settings.push(("port".to_owned(), port.to_string()));
        Ok(standby)
    }

    /// Ends the standby's recovery (`pg_ctl promote`, waiting until it is done): from then
    /// on it takes writes, on the connections it already has too.
    pub fn promote(&self) -> Result<(), BoxError> {
        self.pg_tool(
            "pg_ctl",
            &[
                "-D".to_owned(),
                self.data().display().to_string(),
                "-w".to_owned(),
                "-t".to_owned(),
                "60".to_owned(),
                "promote".to_owned(),
            ],
        )
    }

    /// Stops the server (`pg_ctl stop -m <mode>`: `fast` ends every session with SQLSTATE
    /// 57P01 and closes its socket; `immediate` aborts without a checkpoint). The
    /// directory stays until the cluster is dropped.
    pub fn stop(&self, mode: &str) -> Result<(), BoxError> {
        self.pg_tool(
            "pg_ctl",
            &[
                "-D".to_owned(),
                self.data().display().to_string(),
                "-m".to_owned(),
                mode.to_owned(),
                "-w".to_owned(),
                "-t".to_owned(),
                "60".to_owned(),
                "stop".to_owned(),
            ],
        )
    }

    /// Stops the server (fast) and starts it again on `port`: a failover that hands the old
    /// primary's address to the promoted standby. The port must be free (the old primary
    /// stopped).
    pub fn move_to_port(&mut self, port: u16) -> Result<(), BoxError> {
        self.stop("fast")?;
        let conf = self.data().join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf)?;
        text.push_str(&format!("port = {port}\n"));
        std::fs::write(&conf, text)?;
        self.port = port;
        self.start_server()
    }

    /// Whether the server is a standby in recovery (`pg_is_in_recovery()`).
    pub async fn in_recovery(&self) -> Result<bool, BoxError> {
        let mut conn = self.connect().await?;
        Ok(sqlx::query_scalar("SELECT pg_is_in_recovery()")
            .fetch_one(&mut conn)
            .await?)
    }

    /// Waits until `standby` has replayed everything this primary had written when called
    /// (`pg_current_wal_lsn()` against `pg_last_wal_replay_lsn()`), at most `within`.
    pub async fn wait_replayed(&self, standby: &Cluster, within: Duration) -> Result<(), BoxError> {
        let mut primary = self.connect().await?;
        let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
            .fetch_one(&mut primary)
            .await?;
        let mut conn = standby.connect().await?;
        let started = Instant::now();
        loop {
            let caught_up: bool =
                sqlx::query_scalar("SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn")
                    .bind(&lsn)
                    .fetch_one(&mut conn)
                    .await?;
            if caught_up {
                return Ok(());
            }
            if started.elapsed() > within {
                return Err(
                    format!("the standby did not replay up to {lsn} within {within:?}").into(),
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The server's log so far (`server.log` in its directory).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
    }

    async fn connect(&self) -> Result<sqlx::PgConnection, BoxError> {
        Ok(PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username("postgres")
            .database("postgres")
            .connect()
            .await?)
    }

    /// `pg_ctl start`, waiting until the server accepts connections.
    fn start_server(&self) -> Result<(), BoxError> {
        let log = self.dir.join("server.log");
        if self.as_postgres && !log.exists() {
            std::fs::write(&log, "")?;
            chown_postgres(&log)?;
        }
        self.pg_tool(
            "pg_ctl",
            &[
                "-D".to_owned(),
                self.data().display().to_string(),
                "-l".to_owned(),
                log.display().to_string(),
                "-w".to_owned(),
                "-t".to_owned(),
                "60".to_owned(),
                "start".to_owned(),
            ],
        )
    }
}
