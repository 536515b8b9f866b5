//! A real PgBouncer in transaction mode in front of a Postgres server, configured with the
//! settings block of `docs/guide/deployment.md` ("PgBouncer"), read from the page at start
//! so the docs are tested as written: the integration tests, the command's tests and
//! `outbox-lab pgbouncer` all start theirs here. Each [`PgBouncer`] is its own process on a free port
//! with its own ini in a temporary directory; dropping it stops the process.
//!
//! The launcher adds only what belongs to this machine (where to listen, where the server
//! is, who may log in, where to log) and a small server pool (`default_pool_size = 2`), so
//! clients really share server connections: state left on one by a transaction reaches
//! the next client that gets it, as on a busy production pooler. It refuses a docs block
//! that sets one of those keys itself, or that is not in transaction mode.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicU32, Ordering};

use sqlx::postgres::PgConnectOptions;

/// The page and heading whose `ini` block configures PgBouncer.
pub const DOCS_PAGE: &str = "docs/guide/deployment.md";
/// The heading of the section (any level) that holds the block.
pub const DOCS_HEADING: &str = "PgBouncer";

/// Keys the launcher sets; the docs' block must leave them to each deployment.
const OWN_KEYS: &[&str] = &[
    "listen_addr",
    "listen_port",
    "unix_socket_dir",
    "auth_type",
    "auth_file",
    "logfile",
    "pidfile",
    "default_pool_size",
];

/// The server connections per database and user: small on purpose (see the module docs).
pub const SERVER_POOL_SIZE: u32 = 2;

/// A running PgBouncer; stopped when dropped.
pub struct PgBouncer {
    child: Child,
    dir: PathBuf,
    port: u16,
    url: String,
}

impl PgBouncer {
    /// Starts PgBouncer (the `pgbouncer` binary on `PATH`: Debian's package) in front of
    /// the server of `server_url` and waits until it accepts connections. Panics with
    /// what went wrong (no binary, a bad docs block, an exit at start with its log).
    pub fn start(server_url: &str) -> PgBouncer {
        static STARTED: AtomicU32 = AtomicU32::new(0);
        let settings = docs_settings();
        let opts: PgConnectOptions = server_url.parse().expect("a Postgres URL");
        let user = opts.get_username().to_owned();
        let database = opts.get_database().unwrap_or(&user).to_owned();
        let port = free_port();
        let dir = std::env::temp_dir().join(format!(
            "outbox-pgbouncer-{}-{}",
            std::process::id(),
            STARTED.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the pgbouncer directory");
        // PgBouncer refuses to run as root: it runs as `postgres`, which must write its log.
        set_mode(&dir, 0o777);
        let ini = render_ini(&settings, &dir, port, &opts);
        std::fs::write(dir.join("pgbouncer.ini"), ini).expect("write pgbouncer.ini");
        std::fs::write(dir.join("userlist.txt"), format!("\"{user}\" \"\"\n"))
            .expect("write userlist.txt");
        for f in ["pgbouncer.ini", "userlist.txt"] {
            set_mode(&dir.join(f), 0o644);
        }
        let mut command = if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", "pgbouncer"]);
            c
        } else {
            Command::new("pgbouncer")
        };
        let child = command
            .arg(dir.join("pgbouncer.ini"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start pgbouncer ({e}): install it (`apt-get install -y pgbouncer`); \
                     these tests do not skip"
                )
            });
        let url = format!("postgres://{user}@127.0.0.1:{port}/{database}");
        let mut bouncer = PgBouncer {
            child,
            dir,
            port,
            url,
        };
        bouncer.wait_until_up();
        bouncer
    }

    /// The URL of the pooler (user and database of the server's URL).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The pooler's log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }

    fn wait_until_up(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "pgbouncer exited at start ({status}); its log:\n{}",
                    self.log()
                );
            }
            if Instant::now() > deadline {
                panic!(
                    "pgbouncer did not listen on port {} within 15 s; its log:\n{}",
                    self.port,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        // `runuser` does not pass a SIGKILL on: stop pgbouncer itself, by its pid file.
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("pgbouncer.pid")) {
            let _ = Command::new("kill").arg(pid.trim()).status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The `key = value` lines of the docs' `ini` block (comments and section headers dropped),
/// checked: transaction mode, and none of the launcher's own keys.
pub fn docs_settings() -> Vec<(String, String)> {
    let page = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(DOCS_PAGE);
    let text =
        std::fs::read_to_string(&page).unwrap_or_else(|e| panic!("read {}: {e}", page.display()));
    let block = ini_block(&text, DOCS_HEADING).unwrap_or_else(|| {
        panic!("{DOCS_PAGE} has no ```ini block under a heading {DOCS_HEADING:?}")
    });
    let mut settings = Vec::new();
    for line in block.lines().map(str::trim) {
        if line.is_empty() || line.starts_with(';') || line.starts_with('#') {
            continue;
        }
        if line.starts_with('[') {
            assert_eq!(
                line, "[pgbouncer]",
                "the docs' block configures the [pgbouncer] section only"
            );
            continue;
        }
        let (key, value) = line
            .split_once('=')
            .unwrap_or_else(|| panic!("not a `key = value` line in the docs' block: {line:?}"));
        let key = key.trim().to_owned();
        assert!(
            !OWN_KEYS.contains(&key.as_str()),
            "the docs' block sets `{key}`, which belongs to each deployment"
        );
        settings.push((key, value.trim().to_owned()));
    }
    assert!(
        settings
            .iter()
            .any(|(k, v)| k == "pool_mode" && v == "transaction"),
        "the docs' block must say `pool_mode = transaction`: {settings:?}"
    );
    settings
}

/// The first ```` ```ini ```` block after the heading `heading` (any level), up to the
/// next heading.
pub fn ini_block(page: &str, heading: &str) -> Option<String> {
    let mut lines = page.lines();
    lines.find(|l| l.starts_with('#') && l.trim_start_matches('#').trim() == heading)?;
    let mut block = None::<String>;
    for line in lines {
        match &mut block {
            None if line.starts_with('#') => return None,
            None if line.trim() == "```ini" => block = Some(String::new()),
            None => {}
            Some(_) if line.trim() == "```" => return block,
            Some(b) => {
                b.push_str(line);
                b.push('\n');
            }
        }
    }
    None
}

fn render_ini(
    settings: &[(String, String)],
    dir: &Path,
    port: u16,
    server: &PgConnectOptions,
) -> String {
    let mut ini = format!(
        "[databases]\n* = host={} port={}\n\n[pgbouncer]\n",
        server.get_host(),
        server.get_port()
    );
    ini.push_str("; from docs/guide/deployment.md, \"PgBouncer\"\n");
    for (k, v) in settings {
        ini.push_str(&format!("{k} = {v}\n"));
    }
    ini.push_str(&format!(
        "; this machine's\n\
         listen_addr = 127.0.0.1\n\
         listen_port = {port}\n\
         unix_socket_dir =\n\
         auth_type = trust\n\
         auth_file = {auth}\n\
         logfile = {log}\n\
         pidfile = {pid}\n\
         default_pool_size = {SERVER_POOL_SIZE}\n",
        auth = dir.join("userlist.txt").display(),
        log = dir.join("pgbouncer.log").display(),
        pid = dir.join("pgbouncer.pid").display(),
    ));
    ini
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local address").port()
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_is_the_first_ini_fence_under_its_heading() {
        let page = "# Page\n\n```ini\nnot = this\n```\n\n### PgBouncer\n\ntext\n\n\
                    ```ini\n[pgbouncer]\npool_mode = transaction\n```\n\n```ini\nnor = this\n```\n";
        assert_eq!(
            ini_block(page, "PgBouncer").as_deref(),
            Some("[pgbouncer]\npool_mode = transaction\n")
        );
        // A heading without a block before the next heading has none.
        let bare = "## PgBouncer\n\ntext\n\n## Next\n\n```ini\na = b\n```\n";
        assert_eq!(ini_block(bare, "PgBouncer"), None);
        assert_eq!(ini_block(page, "Other"), None);
    }

    #[test]
    fn the_deployment_guide_block_is_usable() {
        let settings = docs_settings();
        assert!(settings.contains(&("pool_mode".to_owned(), "transaction".to_owned())));
        assert!(settings
            .iter()
            .any(|(k, v)| k == "ignore_startup_parameters" && v.contains("extra_float_digits")));
    }
}
