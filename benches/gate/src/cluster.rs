//! A throwaway Postgres cluster with `pg_stat_statements` preloaded, started from the
//! installed server binaries in a temporary directory on a free port and removed when the
//! [`Cluster`] is dropped (also when the harness fails or is interrupted with Ctrl-C).
//!
//! The main server on this kind of machine does not preload `pg_stat_statements`, and
//! changing that needs a restart of a server other people's tests use; a private cluster
//! avoids both. Its settings mirror the main server's where it is reachable (see
//! [`MIRRORED`]), so figures stay comparable with what the tests see.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Row};

use crate::BoxError;

/// Settings copied from the main server when it answers (else Postgres' defaults apply,
/// except for the ones [`FALLBACK`] pins). Durability settings (`fsync`,
/// `synchronous_commit`, `full_page_writes`) decide the cost of every commit; memory and
/// WAL sizing decide whether a checkpoint can land inside a run.
const MIRRORED: &[&str] = &[
    "shared_buffers",
    "fsync",
    "synchronous_commit",
    "full_page_writes",
    "wal_level",
    "wal_compression",
    "wal_buffers",
    "wal_writer_delay",
    "commit_delay",
    "max_wal_size",
    "min_wal_size",
    "checkpoint_timeout",
    "work_mem",
    "autovacuum",
    "jit",
    "max_connections",
];

/// What this machine's main server runs with (`/etc/postgresql/15/main`), used when it
/// cannot be asked.
const FALLBACK: &[(&str, &str)] = &[
    ("shared_buffers", "128MB"),
    ("max_wal_size", "1GB"),
    ("min_wal_size", "80MB"),
    ("autovacuum", "off"),
];

/// Prefix of the temporary directories, so stale ones (a harness killed with SIGKILL) can
/// be found and removed by the next run.
const DIR_PREFIX: &str = "outbox-bench-pg-";
/// The prefix of clusters started by any other process (the lab, the standby tests). Older
/// builds of the gate sweep `DIR_PREFIX` directories whose pid is not an `outbox-bench`
/// process, so other processes' clusters stay out of their way.
const OTHER_PREFIX: &str = "outbox-pg-";

/// A running throwaway cluster; dropped = stopped and deleted.
pub struct Cluster {
    pub(crate) dir: PathBuf,
    pub(crate) bin: PathBuf,
    pub(crate) port: u16,
    pub(crate) as_postgres: bool,
    /// `name = value` lines written to `postgresql.conf`, for the report.
    pub settings: Vec<(String, String)>,
    pub version: String,
}

impl Cluster {
    /// The DSN of the cluster's `postgres` database.
    pub fn dsn(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Creates and starts a cluster. `mirror` is the DSN of a server whose settings to copy;
    /// `extra` are `name=value` settings applied last (for diagnostics, such as
    /// `synchronous_commit=off` to see what commit flushes cost).
    pub async fn start(mirror: Option<&str>, extra: &[String]) -> Result<Cluster, BoxError> {
        sweep_stale();
        let bin = server_bin()?;
        let as_postgres = running_as_root();
        let mut settings = mirrored_settings(mirror).await;
        let (checksums, settings_from) = match &settings {
            Some((_, c)) => (*c, "mirrored from the main server"),
            None => (false, "fallback (main server not reachable)"),
        };
        let mut conf: Vec<(String, String)> = match settings.take() {
            Some((s, _)) => s,
            None => FALLBACK
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        };
        eprintln!("cluster settings {settings_from}");

        if as_postgres {
            postgres_user_usable()?;
        }
        let dir = make_dir(as_postgres)?;
        eprintln!("cluster directory {}", dir.display());
        let port = free_port()?;
        // From here on, Drop cleans up whatever exists.
        let mut cluster = Cluster {
            dir,
            bin,
            port,
            as_postgres,
            settings: Vec::new(),
            version: String::new(),
        };
        let data = cluster.data();
        let mut initdb = vec![
            "-D".to_owned(),
            data.display().to_string(),
            "-U".to_owned(),
            "postgres".to_owned(),
            "-A".to_owned(),
            "trust".to_owned(),
            "-E".to_owned(),
            "UTF8".to_owned(),
            "--locale=C.UTF-8".to_owned(),
            // A throwaway cluster: skip initdb's fsync of every file (the server's own
            // fsync setting is what the benchmark measures).
            "--no-sync".to_owned(),
        ];
        if checksums {
            initdb.push("--data-checksums".to_owned());
        } else if initdb_major(&cluster.bin)? >= 18 {
            // initdb turns checksums on by default from PostgreSQL 18 (and a checksummed
            // cluster WAL-logs hint bits): off, as the mirrored server has them.
            initdb.push("--no-data-checksums".to_owned());
        }
        cluster.pg_tool("initdb", &initdb)?;

        conf.retain(|(k, _)| k != "max_connections");
        conf.extend(
            [
                ("listen_addresses", "'127.0.0.1'".to_owned()),
                ("port", port.to_string()),
                (
                    "unix_socket_directories",
                    format!("'{}'", cluster.dir.display()),
                ),
                // The harness and the peer connect over TCP without TLS (sqlx is built without
                // a TLS backend); both sides pay the same.
                ("ssl", "off".to_owned()),
                ("max_connections", "100".to_owned()),
                (
                    "shared_preload_libraries",
                    "'pg_stat_statements'".to_owned(),
                ),
                ("pg_stat_statements.max", "10000".to_owned()),
                ("pg_stat_statements.track", "top".to_owned()),
                // BEGIN/COMMIT/LISTEN are round trips too; count them.
                ("pg_stat_statements.track_utility", "on".to_owned()),
                ("pg_stat_statements.save", "off".to_owned()),
                ("track_counts", "on".to_owned()),
                ("logging_collector", "off".to_owned()),
                ("timezone", "'UTC'".to_owned()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v)),
        );
        for kv in extra {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| format!("--pg-set wants name=value, got `{kv}`"))?;
            conf.retain(|(name, _)| name != k.trim());
            conf.push((
                k.trim().to_owned(),
                format!("'{}'", v.trim().replace('\'', "''")),
            ));
        }
        let mut text = String::from("\n# outbox-bench\n");
        for (k, v) in &conf {
            text.push_str(&format!("{k} = {v}\n"));
        }
        let conf_path = data.join("postgresql.conf");
        let mut existing = std::fs::read_to_string(&conf_path)?;
        existing.push_str(&text);
        std::fs::write(&conf_path, existing)?;
        cluster.settings = conf;

        let log = cluster.dir.join("server.log");
        if as_postgres {
            // The log file must be writable by the server.
            std::fs::write(&log, "")?;
            chown_postgres(&log)?;
        }
        cluster.pg_tool(
            "pg_ctl",
            &[
                "-D".to_owned(),
                data.display().to_string(),
                "-l".to_owned(),
                log.display().to_string(),
                "-w".to_owned(),
                "-t".to_owned(),
                "60".to_owned(),
                "start".to_owned(),
            ],
        )?;
        let mut conn = PgConnectOptions::new()
            .host("127.0.0.1")
            .port(port)
            .username("postgres")
            .database("postgres")
            .connect()
            .await?;
        sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .execute(&mut conn)
            .await?;
        cluster.version = sqlx::query("SELECT version()")
            .fetch_one(&mut conn)
            .await?
            .try_get(0)?;
        Ok(cluster)
    }

    /// `pg_waldump --stats=record` between two LSNs: which WAL records a run wrote.
    pub fn waldump(&self, start: &str, end: &str) -> Result<String, BoxError> {
        let out = Command::new(self.bin.join("pg_waldump"))
            .args(["--stats=record", "-p"])
            .arg(self.data().join("pg_wal"))
            .args(["-s", start, "-e", end])
            .output()?;
        if !out.status.success() {
            return Err(format!("pg_waldump: {}", String::from_utf8_lossy(&out.stderr)).into());
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    pub(crate) fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// Runs a server binary, as the `postgres` OS user when we are root (initdb and the
    /// server refuse to run as root).
    pub(crate) fn pg_tool(&self, tool: &str, args: &[String]) -> Result<(), BoxError> {
        self.control().pg_tool(tool, args)
    }

    /// A handle that can restart the server from another task while the cluster runs
    /// (the fault matrix, `faults.rs`); it does not own the cluster.
    pub fn control(&self) -> Control {
        Control {
            dir: self.dir.clone(),
            bin: self.bin.clone(),
            as_postgres: self.as_postgres,
        }
    }
}

/// Runs the server's tools against a running [`Cluster`] without owning it.
#[derive(Debug, Clone)]
pub struct Control {
    pub(crate) dir: PathBuf,
    pub(crate) bin: PathBuf,
    pub(crate) as_postgres: bool,
}

impl Control {
    /// `pg_ctl restart -m <mode>` (`fast`, `immediate` or `smart`), waiting until the
    /// server accepts connections again. Blocking: call it from `spawn_blocking`.
    pub fn restart(&self, mode: &str) -> Result<(), BoxError> {
        let data = self.dir.join("data").display().to_string();
        // `-l` again: without it the restarted server would write to pg_ctl's stdout,
        // which we capture, and pg_ctl's output would never end.
        let log = self.dir.join("server.log").display().to_string();
        self.pg_tool(
            "pg_ctl",
            &[
                "-D".to_owned(),
                data,
                "-l".to_owned(),
                log,
                "-m".to_owned(),
                mode.to_owned(),
                "-w".to_owned(),
                "-t".to_owned(),
                "60".to_owned(),
                "restart".to_owned(),
            ],
        )
    }

    /// Runs a server binary, as the `postgres` OS user when we are root (initdb and the
    /// server refuse to run as root).
    pub(crate) fn pg_tool(&self, tool: &str, args: &[String]) -> Result<(), BoxError> {
        let exe = self.bin.join(tool);
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&exe);
            c
        } else {
            Command::new(&exe)
        };
        cmd.args(args).current_dir(&self.dir);
        let out = cmd
            .output()
            .map_err(|e| format!("running {}: {e}", exe.display()))?;
        if !out.status.success() {
            let log = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
            return Err(format!(
                "{tool} failed ({}{}) in {}: {}{}\n{}",
                out.status,
                if self.as_postgres {
                    ", run as the postgres OS user"
                } else {
                    ""
                },
                self.dir.display(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
                log
            )
            .into());
        }
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.data().join("postmaster.pid").exists() {
            let data = self.data().display().to_string();
            let stop = |mode: &str| {
                self.pg_tool(
                    "pg_ctl",
                    &[
                        "-D".to_owned(),
                        data.clone(),
                        "-m".to_owned(),
                        mode.to_owned(),
                        "-w".to_owned(),
                        "-t".to_owned(),
                        "20".to_owned(),
                        "stop".to_owned(),
                    ],
                )
            };
            if let Err(e) = stop("fast") {
                eprintln!("stopping the throwaway cluster: {e}; trying immediate");
                let _ = stop("immediate");
            }
        }
        if let Err(e) = std::fs::remove_dir_all(&self.dir) {
            eprintln!("removing {}: {e}", self.dir.display());
        }
    }
}

/// `/usr/lib/postgresql/<highest version>/bin`, or `$PG_BIN`.
fn server_bin() -> Result<PathBuf, BoxError> {
    if let Some(p) = std::env::var_os("PG_BIN") {
        return Ok(PathBuf::from(p));
    }
    let root = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir(root)
        .map_err(|e| format!("no Postgres server binaries under {}: {e}", root.display()))?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions.pop().map(|(_, b)| b).ok_or_else(|| {
        format!(
            "no initdb under {}/<version>/bin; install the postgresql package or set PG_BIN",
            root.display()
        )
        .into()
    })
}

/// The major version of `initdb` in `bin` (`initdb (PostgreSQL) 18.4` and
/// `initdb (PostgreSQL) 15.20 (Debian 15.20-0+deb12u1)` are 18 and 15).
fn initdb_major(bin: &Path) -> Result<u32, BoxError> {
    let out = Command::new(bin.join("initdb")).arg("--version").output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .skip_while(|w| *w != "(PostgreSQL)")
        .nth(1)
        .and_then(|v| v.split('.').next()?.parse().ok())
        .ok_or_else(|| format!("cannot read the version of initdb: `{}`", text.trim()).into())
}

pub(crate) fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// As root the server binaries run as the `postgres` OS user (initdb and the server
/// refuse root): it must exist, and `runuser` must be there to switch to it.
fn postgres_user_usable() -> Result<(), BoxError> {
    let user = Command::new("id").args(["-u", "postgres"]).output();
    if !user.is_ok_and(|o| o.status.success()) {
        return Err(
            "running as root, the throwaway cluster runs as the `postgres` OS user, \
             which does not exist here; install the postgresql package (it creates the user), \
             run as an ordinary user, or pass --dsn with a server that preloads pg_stat_statements"
                .into(),
        );
    }
    match Command::new("runuser").arg("--version").output() {
        Ok(o) if o.status.success() => Ok(()),
        _ => Err(
            "running as root, the throwaway cluster needs `runuser` (util-linux) to run \
             initdb and pg_ctl as the `postgres` OS user; it is not usable here"
                .into(),
        ),
    }
}

/// Where throwaway clusters live: the temporary directory, and `/tmp` besides it when that
/// is another one (as root, the `postgres` user may not reach a private `$TMPDIR`).
fn parents() -> Vec<PathBuf> {
    let mut v = vec![std::env::temp_dir()];
    let tmp = PathBuf::from("/tmp");
    if !v.contains(&tmp) && tmp.is_dir() {
        v.push(tmp);
    }
    v
}

/// Creates the cluster's directory, owned by the `postgres` user when `as_postgres`, in the
/// first of [`parents`] that user can reach (every directory above it must let it through).
pub(crate) fn make_dir(as_postgres: bool) -> Result<PathBuf, BoxError> {
    let mut tried = Vec::new();
    for parent in parents() {
        let dir = parent.join(format!(
            "{}{}-{}",
            if own_comm() == "outbox-bench" {
                DIR_PREFIX
            } else {
                OTHER_PREFIX
            },
            std::process::id(),
            rand::random::<u32>()
        ));
        if let Err(e) = std::fs::create_dir_all(&dir) {
            tried.push(format!("{}: {e}", dir.display()));
            continue;
        }
        let made = (|| -> Result<(), BoxError> {
            // The process's name, then its pid: a test binary's clusters (the standby tests)
            // are as alive as the harness's.
            std::fs::write(dir.join("harness.name"), own_comm())?;
            std::fs::write(dir.join("harness.pid"), std::process::id().to_string())?;
            if as_postgres {
                chown_postgres(&dir)?;
                let reach = Command::new("runuser")
                    .args(["-u", "postgres", "--", "test", "-w"])
                    .arg(&dir)
                    .status()?;
                if !reach.success() {
                    return Err(
                        "the postgres user cannot write there (a directory above it \
                                is closed to it)"
                            .into(),
                    );
                }
            }
            Ok(())
        })();
        match made {
            Ok(()) => return Ok(dir),
            Err(e) => {
                tried.push(format!("{}: {e}", dir.display()));
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
    }
    Err(format!(
        "no directory for the throwaway cluster ({}); set TMPDIR to a directory{} can write",
        tried.join("; "),
        if as_postgres {
            " the postgres user"
        } else {
            " you"
        }
    )
    .into())
}

pub(crate) fn chown_postgres(path: &Path) -> Result<(), BoxError> {
    let st = Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(path)
        .status()?;
    if !st.success() {
        return Err(format!("chown postgres {} failed", path.display()).into());
    }
    Ok(())
}

pub(crate) fn free_port() -> Result<u16, BoxError> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// Reads [`MIRRORED`] (and whether data checksums are on) from the main server.
async fn mirrored_settings(dsn: Option<&str>) -> Option<(Vec<(String, String)>, bool)> {
    let dsn = dsn?;
    let opts: PgConnectOptions = dsn.parse().ok()?;
    let connect = tokio::time::timeout(Duration::from_secs(3), opts.connect());
    let mut conn = connect.await.ok()?.ok()?;
    let rows = sqlx::query(
        "/* outbox-bench probe */ SELECT name, current_setting(name) FROM pg_settings \
         WHERE name = ANY($1)",
    )
    .bind(MIRRORED)
    .fetch_all(&mut conn)
    .await
    .ok()?;
    let mut out = Vec::new();
    for r in rows {
        let name: String = r.try_get(0).ok()?;
        let value: String = r.try_get(1).ok()?;
        out.push((name, format!("'{}'", value.replace('\'', "''"))));
    }
    out.sort();
    let checksums: String = sqlx::query_scalar("SHOW data_checksums")
        .fetch_one(&mut conn)
        .await
        .ok()?;
    Some((out, checksums == "on"))
}

/// This process's name as `/proc/<pid>/stat` shows it.
fn own_comm() -> String {
    std::fs::read_to_string("/proc/self/comm")
        .map(|c| c.trim().to_owned())
        .unwrap_or_default()
}

/// Whether `pid` is a running (not zombie) process named `name` (`harness.name`;
/// `outbox-bench` for a directory of an older run, which has none).
fn harness_alive(pid: &str, name: &str) -> bool {
    if pid.is_empty() || name.is_empty() {
        return false;
    }
    let stat =
        std::fs::read_to_string(Path::new("/proc").join(pid).join("stat")).unwrap_or_default();
    // `pid (comm) state …`
    let Some((comm, rest)) = stat.split_once(") ") else {
        return false;
    };
    comm.split_once('(').is_some_and(|(_, c)| c == name) && !rest.starts_with('Z')
}

/// Removes clusters left behind by a harness that was killed (its pid is gone).
fn sweep_stale() {
    let entries = parents()
        .into_iter()
        .filter_map(|p| std::fs::read_dir(p).ok())
        .flatten();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with(DIR_PREFIX) && !name.starts_with(OTHER_PREFIX) {
            continue;
        }
        let dir = e.path();
        let owner = std::fs::read_to_string(dir.join("harness.pid")).unwrap_or_default();
        // A directory another process is still making has no pid yet.
        let young = e
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|age| age < Duration::from_secs(60)));
        if owner.trim().is_empty() && young {
            continue;
        }
        let process = std::fs::read_to_string(dir.join("harness.name"))
            .unwrap_or_else(|_| "outbox-bench".to_owned());
        if harness_alive(owner.trim(), process.trim()) {
            continue;
        }
        eprintln!("removing a stale throwaway cluster: {}", dir.display());
        let Ok(bin) = server_bin() else { return };
        let stale = Cluster {
            dir,
            bin,
            port: 0,
            as_postgres: running_as_root(),
            settings: Vec::new(),
            version: String::new(),
        };
        drop(stale);
    }
}
