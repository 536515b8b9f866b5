//! The `outbox` binary against Postgres (`DATABASE_URL`, default the local test server):
//! each test makes its own tables through the library, runs the binary on them with
//! `--table`, and checks its output and exit status.

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use outbox::{Message, Outbox};
use serde_json::Value;
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool};

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// Fresh, migrated tables of a unique name (dead-letter queue on), and a pool.
struct Tables {
    name: String,
    outbox: Outbox,
    pool: PgPool,
}

impl Tables {
    async fn new() -> Tables {
        Tables::with(true, true).await
    }

    /// Tables of a unique name, migrated (`migrate`) with the dead-letter table on or off.
    async fn with(dead_letter: bool, migrate: bool) -> Tables {
        let name = format!("cli_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect(&database_url())
            .await
            .unwrap_or_else(|e| panic!("Postgres at DATABASE_URL must be reachable: {e}"));
        let outbox = Outbox::builder()
            .table(&name)
            .dead_letter(dead_letter)
            .build()
            .unwrap();
        if migrate {
            outbox.migrate(&pool).await.unwrap();
        }
        Tables { name, outbox, pool }
    }

    /// Runs `outbox --table <name> args…` to completion.
    fn run(&self, args: &[&str]) -> Output {
        outbox_cmd()
            .args(["--table", &self.name])
            .args(args)
            .output()
            .expect("the binary runs")
    }

    /// As `run`, expecting success and one JSON document on stdout.
    fn json(&self, args: &[&str]) -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let out = self.run(&all);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {}", text(&out.stdout)))
    }

    async fn exec(&self, sql: String) {
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&self.pool)
            .await
            .unwrap();
    }

    async fn cleanup(self) {
        // The dead-letter table is named whether or not it is on.
        let dlq = format!("{}_dlq", self.name);
        self.exec(format!(
            "DROP TABLE IF EXISTS {}, {dlq}, {}, {}",
            self.outbox.table(),
            self.outbox.migrations_table(),
            self.outbox.paused_table()
        ))
        .await;
    }
}

fn outbox_cmd() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_outbox"));
    c.env("DATABASE_URL", database_url());
    c
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The stats of `queue` in a `status --json` document.
fn queue_of<'a>(status: &'a Value, queue: &str) -> &'a Value {
    status["queues"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["queue"] == queue)
        .unwrap_or_else(|| panic!("{queue} in {status}"))
}

#[tokio::test]
async fn migrate_and_validate() {
    let t = Tables::new().await;
    let out = t.run(&["migrate"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("outbox_paused_queues"), "{stdout}");
    assert!(stdout.contains("is up to date"), "{stdout}");
    let steps = t.json(&["migrate"]);
    assert_eq!(
        steps["steps"].as_array().unwrap().len(),
        t.outbox.migration_steps().len()
    );
    // The names as given, not quoted for SQL.
    assert_eq!(steps["table"], t.name.as_str(), "{steps}");
    assert_eq!(steps["schema"], Value::Null, "{steps}");
    assert_eq!(t.json(&["validate"])["ok"], true);
    let out = t.run(&["validate"]);
    assert!(text(&out.stdout).contains("is valid"));

    // A missing piece: listed, exit status 1, and the fix named.
    t.exec(format!("DROP TABLE {}", t.outbox.paused_table()))
        .await;
    let out = t.run(&["--dead-letter", "validate"]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains(&format!(
            "{}_paused: table is missing (run `outbox --table {} migrate --dead-letter`)",
            t.name, t.name
        )),
        "{stdout}"
    );
    assert!(
        !stdout.contains("Outbox::migrate") && !stdout.contains("run the migrations"),
        "{stdout}"
    );
    assert!(
        text(&out.stderr).contains(&format!("run `outbox --table {} migrate", t.name)),
        "{}",
        text(&out.stderr)
    );
    assert!(t.run(&["migrate"]).status.success());
    assert_eq!(t.json(&["validate"])["ok"], true);
    t.cleanup().await;
}

#[tokio::test]
async fn status_pending_pause_and_resume() {
    let t = Tables::new().await;
    let mut conn = t.pool.acquire().await.unwrap();
    for p in [b"a", b"b"] {
        t.outbox
            .publish(&mut conn, Message::new("cli.q", p))
            .await
            .unwrap();
    }
    t.outbox
        .publish(
            &mut conn,
            Message::new("cli.q", b"later")
                .timer_id("k")
                .schedule(Duration::from_secs(3600)),
        )
        .await
        .unwrap();
    drop(conn);

    let status = t.json(&["status"]);
    assert_eq!(status["table"], t.name.as_str(), "{status}");
    let q = queue_of(&status, "cli.q");
    assert_eq!(q["pending"], 3, "{q}");
    assert_eq!(q["due"], 2, "{q}");
    assert_eq!(q["leased"], 0, "{q}");
    assert_eq!(q["paused"], false, "{q}");
    let table = text(&t.run(&["status"]).stdout);
    assert!(
        table.contains("cli.q") && table.contains("running"),
        "{table}"
    );

    let out = t.run(&["pause", "cli.q"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "cli.q: paused");
    assert_eq!(
        text(&t.run(&["pause", "cli.q"]).stdout).trim(),
        "cli.q: already paused"
    );
    assert_eq!(queue_of(&t.json(&["status"]), "cli.q")["paused"], true);
    assert!(text(&t.run(&["status"]).stdout).contains("paused"));
    // A paused queue without rows is listed too.
    t.run(&["pause", "cli.empty"]);
    assert_eq!(
        t.json(&["status"])["paused"],
        serde_json::json!(["cli.empty", "cli.q"])
    );

    let pending = t.json(&["pending", "cli.q"]);
    let rows = pending["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0]["payload"], "a");
    assert_eq!(rows[2]["timer_id"], "k");
    assert_eq!(rows[2]["state"], "pending");
    let table = text(&t.run(&["pending", "cli.q", "--limit", "2"]).stdout);
    assert!(table.contains("2 row(s) of cli.q"), "{table}");

    let resumed = t.json(&["resume", "cli.q"]);
    assert_eq!(resumed["changed"], true);
    assert_eq!(resumed["state"], "running");
    t.cleanup().await;
}

#[tokio::test]
async fn dead_letters_list_redrive_and_purge() {
    let t = Tables::new().await;
    let dlq = t.outbox.dead_letter_table();
    t.exec(format!(
        "INSERT INTO {dlq} (original_id, queue, payload, timer_id, attempts_count, \
         deliveries_count, created_at, failed_at, failure_reason, last_error) VALUES \
         (1, 'cli.q', 'one', NULL, 1, 1, now(), now() - interval '2 hours', 'rejected', 'no'), \
         (2, 'cli.q', 'two', 'k2', 3, 3, now(), now(), 'retry_exhausted', 'boom'), \
         (3, 'cli.other', 'three', NULL, 0, 5, now(), now(), 'max_deliveries', NULL)"
    ))
    .await;

    // `status` counts dead letters when told the application has them.
    assert_eq!(
        queue_of(&t.json(&["--dead-letter", "status"]), "cli.q")["dead_letters"],
        2
    );
    assert_eq!(
        t.json(&["status"])["queues"],
        serde_json::json!([]),
        "without --dead-letter a queue of dead letters only is not listed"
    );
    let all = t.json(&["dlq", "list"]);
    let ids: Vec<i64> = all["dead_letters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_i64().unwrap())
        .collect();
    assert_eq!(ids.len(), 3);
    let page = t.json(&["dlq", "list", "--limit", "2"]);
    assert_eq!(page["next_after"], ids[1]);
    let rest = t.json(&["dlq", "list", "--after", &ids[1].to_string()]);
    assert_eq!(rest["dead_letters"][0]["id"], ids[2]);
    let rejected = t.json(&["dlq", "list", "--reason", "rejected"]);
    assert_eq!(rejected["dead_letters"].as_array().unwrap().len(), 1);
    let table = text(&t.run(&["dlq", "list", "--queue", "cli.q"]).stdout);
    assert!(
        table.contains("retry_exhausted") && table.contains("boom"),
        "{table}"
    );

    let out = t.run(&["dlq", "redrive", "--id", &ids[1].to_string()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("redriven as row"),
        "{}",
        text(&out.stdout)
    );
    let again = t.json(&["dlq", "redrive", "--id", &ids[1].to_string()]);
    assert_eq!(again["redriven"], 0);
    assert_eq!(again["outcomes"][0]["result"], "already_redriven");
    let live = t.json(&["pending", "cli.q"]);
    assert_eq!(live["rows"][0]["timer_id"], "k2");
    assert_eq!(live["rows"][0]["payload"], "two");
    assert_eq!(
        live["rows"][0]["headers"]["outbox-redriven-from"],
        ids[1].to_string()
    );

    let purged = t.json(&["dlq", "purge", "--older-than", "1h"]);
    assert_eq!(
        purged["deleted"], 1,
        "only the dead letter from two hours ago"
    );
    assert_eq!(
        t.json(&["dlq", "list", "--include-redriven"])["dead_letters"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    t.cleanup().await;
}

#[tokio::test]
async fn status_watch_refreshes() {
    let t = Tables::new().await;
    let mut child = outbox_cmd()
        .args(["--table", &t.name, "--json", "status", "--watch", "100ms"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for _ in 0..2 {
        let line = lines.next().expect("a refresh").unwrap();
        let v: Value = serde_json::from_str(&line).unwrap();
        assert!(v["queues"].is_array(), "{v}");
    }
    child.kill().unwrap();
    child.wait().unwrap();
    t.cleanup().await;
}

#[tokio::test]
async fn errors_say_what_to_do() {
    // No tables of that name: run migrate.
    let out = outbox_cmd()
        .args(["--table", "cli_never_migrated", "pending", "q"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("run `outbox --table cli_never_migrated migrate`"),
        "{err}"
    );

    // A table that is not an outbox table: said so, with the names to check (found by a
    // fresh-user trial: a raw "column … does not exist").
    for args in [
        &["--table", "pg_class", "status"][..],
        &["--table", "pg_class", "pending", "q"],
        &["--dead-letter-table", "pg_class", "dlq", "list"],
    ] {
        let out = outbox_cmd().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = text(&out.stderr);
        assert!(
            err.contains("are not outbox tables (missing: ")
                && err.contains("pg_class")
                && err.contains("` lists every difference"),
            "{args:?}: {err}"
        );
    }

    // An unreachable server: the URL (password hidden) and what to check.
    let out = outbox_cmd()
        .args([
            "--database-url",
            "postgres://postgres:hunter2@127.0.0.1:1/test",
            "status",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("cannot reach Postgres at postgres://postgres:***@127.0.0.1:1/test"),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "{err}");

    // No URL at all.
    let out = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .env_remove("DATABASE_URL")
        .arg("status")
        .output()
        .unwrap();
    assert!(
        text(&out.stderr).contains("pass --database-url"),
        "{}",
        text(&out.stderr)
    );

    // Bad input: refused with the rule, before anything is written.
    let t = Tables::new().await;
    let out = t.run(&["pause", ""]);
    assert_eq!(out.status.code(), Some(2), "a usage error");
    assert!(text(&out.stderr).contains("queue"), "{}", text(&out.stderr));
    // The options' own names, not the library's (found by the fresh-user trial of
    // 2026-12-05: "failed_after (…) must be earlier than failed_before (…)").
    let out = t.run(&[
        "dlq",
        "list",
        "--since",
        "2027-01-01T00:00:00Z",
        "--until",
        "2026-01-01T00:00:00Z",
    ]);
    assert_eq!(out.status.code(), Some(2), "a usage error");
    assert!(
        text(&out.stderr)
            .contains("--since (2027-01-01 00:00:00 UTC) must be earlier than --until"),
        "{}",
        text(&out.stderr)
    );
    let out = t.run(&["dlq", "list", "--limit", "0"]);
    assert!(
        text(&out.stderr).contains("\"0\" is not a whole number of at least 1"),
        "{}",
        text(&out.stderr)
    );
    let out = t.run(&["dlq", "list", "--reason", "nope"]);
    assert!(
        text(&out.stderr).contains("use one of max_deliveries, retry_exhausted"),
        "{}",
        text(&out.stderr)
    );
    // Either --id or --all, and the usage line says so (a fresh-user trial read
    // `Usage: outbox dlq redrive --id <IDS>` after `--id 1 --all`).
    for args in [
        &["dlq", "redrive"][..],
        &["dlq", "redrive", "--id", "1", "--all"],
    ] {
        let out = t.run(args);
        assert_eq!(out.status.code(), Some(2), "a usage error");
        assert!(
            text(&out.stderr).contains("Usage: outbox dlq redrive ")
                && text(&out.stderr).contains(" <--id <IDS>|--all>"),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
    let out = t.run(&["status", "--lease-ttl", "soon"]);
    assert_eq!(out.status.code(), Some(2), "a usage error");
    let long = "x".repeat(70);
    let out = outbox_cmd()
        .args(["--table", &long, "status"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "a usage error");
    assert!(
        text(&out.stderr).contains("63 bytes"),
        "{}",
        text(&out.stderr)
    );
    t.cleanup().await;
}

/// The binary has no TLS: a URL that requires it is refused with that said, not with "check
/// that the server is running" (found by a fresh-user trial).
#[tokio::test]
async fn a_database_url_that_requires_tls_is_refused_saying_why() {
    let base = database_url();
    let sep = if base.contains('?') { '&' } else { '?' };
    let out = outbox_cmd()
        .args(["status"])
        .env("DATABASE_URL", format!("{base}{sep}sslmode=require"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains("this build of the outbox command has no TLS")
            && !err.contains("server is running"),
        "{err}"
    );
}

/// Runs `outbox args…` (no `--table`), to completion.
fn run_bare(args: &[&str]) -> Output {
    outbox_cmd().args(args).output().expect("the binary runs")
}

#[tokio::test]
async fn dead_letter_advice_names_migrate_with_dead_letter() {
    // Migrated with the dead-letter table off: its redrive columns are missing.
    let t = Tables::with(false, true).await;
    let fix = format!("outbox --table {} migrate --dead-letter", t.name);
    let out = t.run(&["dlq", "list"]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains(&format!("run `{fix}`")), "{err}");
    assert!(err.contains("lacks what this command needs"), "{err}");
    assert!(!err.contains("predates"), "{err}");
    // validate in the CLI's words, with the same command.
    let out = t.run(&["--dead-letter", "validate"]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = text(&out.stdout);
    assert!(stdout.contains(&format!("(run `{fix}`)")), "{stdout}");
    assert!(!stdout.contains("Outbox::migrate"), "{stdout}");
    let out = t.run(&["--json", "--dead-letter", "validate"]);
    assert_eq!(out.status.code(), Some(1));
    let problems: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        problems["problems"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["needs_upgrade"] == true && p["fix"] == fix.as_str()),
        "{problems}"
    );
    // The advice works: after it, the command does.
    let out = t.run(&["migrate", "--dead-letter"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(t.run(&["dlq", "list"]).status.success());
    t.cleanup().await;
}

#[tokio::test]
async fn migrate_tells_this_runs_steps_from_earlier_ones() {
    let t = Tables::with(true, false).await;
    let first = t.run(&["--dead-letter", "migrate"]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    let stdout = text(&first.stdout);
    let n = t.outbox.migration_steps().len();
    assert!(stdout.contains("applied now"), "{stdout}");
    assert!(!stdout.contains("applied earlier"), "{stdout}");
    assert!(
        stdout.contains(&format!("is up to date; {n} step(s) applied now")),
        "{stdout}"
    );
    let second = text(&t.run(&["--dead-letter", "migrate"]).stdout);
    assert!(second.contains("applied earlier"), "{second}");
    assert!(!second.contains("applied now\u{20}"), "{second}");
    assert!(
        second.contains("is up to date; 0 step(s) applied now"),
        "{second}"
    );
    assert_eq!(t.json(&["--dead-letter", "migrate"])["applied_now"], 0);
    t.cleanup().await;
}

#[test]
fn database_urls_of_other_databases_are_refused_and_passwords_hidden() {
    let out = run_bare(&["--database-url", "mysql://u:hunter2@h/db", "status"]);
    assert_eq!(out.status.code(), Some(2), "a usage error");
    let err = text(&out.stderr);
    assert!(
        err.contains("mysql://") && err.contains("Postgres"),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "{err}");
    // A password in the query is hidden too.
    let out = run_bare(&[
        "--database-url",
        "postgres:///test?host=127.0.0.1&port=1&user=u&password=hunter2",
        "status",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("password=***"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
    // No URL: a usage error.
    let out = Command::new(env!("CARGO_BIN_EXE_outbox"))
        .env_remove("DATABASE_URL")
        .arg("status")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[tokio::test]
async fn a_closed_pipe_ends_watch_quietly() {
    let t = Tables::new().await;
    let mut child = outbox_cmd()
        .args(["--table", &t.name, "status", "--watch", "100ms"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    lines.next().expect("a first line").unwrap();
    drop(lines);
    // The next refresh (100 ms on) finds the pipe closed; allow 30x that.
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("status --watch kept running after its reader left");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    t.cleanup().await;
}

#[tokio::test]
async fn usage_errors_exit_2_and_json_errors_are_json() {
    let t = Tables::new().await;
    for args in [
        &["dlq", "redrive"][..],
        &["dlq", "redrive", "--id", "13", "--queue", "other"],
        &["dlq", "redrive", "--id", "13", "--all"],
        &["dlq", "redrive", "--id", "13", "--limit", "5"],
        &["dlq", "redrive", "--all", "--include-redriven"],
        &["dlq", "redrive", "--id", "0"],
        &["dlq", "list", "--reason", "nope"],
        &["dlq", "list", "--limit", "0"],
        &[
            "dlq",
            "list",
            "--since",
            "2026-02-01T00:00:00Z",
            "--until",
            "2026-01-01T00:00:00Z",
        ],
        &["dlq", "redrive", "--all", "--limit", "0"],
        &["pending", "q", "--limit", "0"],
        &["pending", ""],
        &["pending"],
        &["status", "--watch", "10ms"],
        &["run-now", "0"],
        &["--distributed", "0", "status"],
        &["--distributed", "257", "status"],
        &["reschedule", "1"],
        &[
            "reschedule",
            "1",
            "--in",
            "5m",
            "--at",
            "2026-01-01T00:00:00Z",
        ],
    ] {
        let out = t.run(args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
    // DATABASE_URL is set (`t.run`): the usage line does not show --database-url as if it
    // had been typed.
    let usage = text(&t.run(&["pending"]).stderr);
    assert!(
        usage.contains("Usage: outbox pending") && !usage.contains("--database-url"),
        "{usage}"
    );
    // --include-redriven stays an option of list.
    assert!(t
        .run(&["dlq", "list", "--include-redriven"])
        .status
        .success());
    // The exit statuses are in --help, not only in the README (fresh-user trial,
    // 2026-12-05).
    let help = text(&t.run(&["--help"]).stdout);
    assert!(
        help.contains("Exit status: 0 on success; 1 on a failure"),
        "{help}"
    );
    let help = text(&t.run(&["status", "--help"]).stdout);
    assert!(help.contains("a bare --watch refreshes every 2s"), "{help}");
    let help = text(&t.run(&["dlq", "redrive", "--help"]).stdout);
    assert!(help.contains("Exit status 1"), "{help}");

    // With --json an error is one JSON object on stderr, ours and clap's alike.
    for (args, code) in [
        (&["--json", "dlq", "redrive"][..], 2),
        (&["--json", "dlq", "redrive", "--id", "0"], 2),
        (&["--json", "run-now", "999999999"], 1),
    ] {
        let out = t.run(args);
        assert_eq!(out.status.code(), Some(code), "{args:?}");
        let err: Value = serde_json::from_slice(&out.stderr)
            .unwrap_or_else(|e| panic!("{args:?}: {e}: {}", text(&out.stderr)));
        assert_eq!(err["exit_code"], code, "{err}");
        assert!(
            err["error"].as_str().is_some_and(|s| !s.is_empty()),
            "{err}"
        );
    }
    t.cleanup().await;
}

#[tokio::test]
async fn redrive_fails_when_a_dead_letter_stays() {
    let t = Tables::new().await;
    let dlq = t.outbox.dead_letter_table();
    t.exec(format!(
        "INSERT INTO {dlq} (original_id, queue, payload, attempts_count, deliveries_count, \
         created_at, failed_at, failure_reason, last_error) VALUES \
         (41, 'cli.q', '\\xff00'::bytea, 1, 1, now(), now(), 'rejected', \
          'line one\n   line two ' || repeat('x', 200))"
    ))
    .await;
    let list = t.json(&["dlq", "list"]);
    let d = &list["dead_letters"][0];
    assert_eq!(d["payload"], Value::Null);
    assert_eq!(d["payload_hex"], "ff00");
    let id = d["id"].as_i64().unwrap();
    let table = text(&t.run(&["dlq", "list"]).stdout);
    assert!(
        table.contains("original id") && table.contains("41"),
        "{table}"
    );
    assert!(table.contains("line one line two"), "{table}");
    assert!(!table.contains(&"x".repeat(100)), "{table}");

    // One found, one not: the outcomes are printed, and the exit status says one stayed.
    let out = t.run(&["dlq", "redrive", "--id", &format!("{id},999999999")]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("redriven as row") && stdout.contains("no such dead letter"),
        "{stdout}"
    );
    assert!(
        text(&out.stderr).contains("999999999"),
        "{}",
        text(&out.stderr)
    );
    // Already redriven counts as done.
    assert!(t
        .run(&["dlq", "redrive", "--id", &id.to_string()])
        .status
        .success());
    t.cleanup().await;
}

#[tokio::test]
async fn pause_resume_and_pending_say_what_they_did() {
    let t = Tables::new().await;
    let out = t.run(&["resume", "nothere"]);
    assert!(out.status.success());
    assert_eq!(
        text(&out.stdout).trim(),
        "nothere was not paused: nothing to resume"
    );
    let out = t.run(&["pause", "nothere"]);
    assert!(out.status.success());
    assert!(
        text(&out.stdout).contains("(no rows in it now: check the name)"),
        "{}",
        text(&out.stdout)
    );
    assert_eq!(t.json(&["pause", "nothere"])["rows_now"], false);

    let mut conn = t.pool.acquire().await.unwrap();
    for p in [b"a", b"b"] {
        t.outbox
            .publish(&mut conn, Message::new("cli.p", p))
            .await
            .unwrap();
    }
    drop(conn);
    let out = text(&t.run(&["pause", "cli.p"]).stdout);
    assert_eq!(out.trim(), "cli.p: paused");
    let full = text(&t.run(&["pending", "cli.p", "--limit", "2"]).stdout);
    assert!(
        full.contains("deadline") && !full.contains(" due "),
        "{full}"
    );
    assert!(
        full.contains("(limit reached: more rows may exist; raise --limit)"),
        "{full}"
    );
    let all = text(&t.run(&["pending", "cli.p", "--limit", "3"]).stdout);
    assert!(!all.contains("limit reached"), "{all}");
    t.cleanup().await;
}

#[tokio::test]
async fn run_now_reschedule_and_delete_one_row() {
    let t = Tables::new().await;
    let mut conn = t.pool.acquire().await.unwrap();
    let mut ids = Vec::new();
    for p in [b"a", b"b"] {
        let published = t
            .outbox
            .publish(
                &mut conn,
                Message::new("cli.r", p).schedule(Duration::from_secs(3600)),
            )
            .await
            .unwrap();
        ids.push(published.id().expect("a new row").to_string());
    }
    drop(conn);
    let (a, b) = (&ids[0], &ids[1]);

    let moved = t.json(&["reschedule", a, "--in", "2h"]);
    assert_eq!(moved["result"], "rescheduled");
    let at = t.json(&["reschedule", a, "--at", "2030-01-01T00:00:00Z"]);
    assert_eq!(at["next_attempt_at"], "2030-01-01T00:00:00.000Z");
    let out = t.run(&["run-now", a]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains(&format!("row {a}: due at")));
    let pending = t.json(&["pending", "cli.r"]);
    assert_eq!(pending["rows"][0]["id"].to_string(), *a, "{pending}");

    let out = t.run(&["delete", a]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = t.run(&["delete", a]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("no live row has id"),
        "{}",
        text(&out.stderr)
    );

    // A leased row is left alone, and the exit status says so.
    t.exec(format!(
        "UPDATE {} SET acquired_token = gen_random_uuid(), acquired_at = now() WHERE id = {b}",
        t.outbox.table()
    ))
    .await;
    for args in [
        &["run-now", b][..],
        &["delete", b],
        &["reschedule", b, "--in", "1m"],
    ] {
        let out = t.run(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(
            text(&out.stderr).contains("a worker holds it")
                && text(&out.stderr).contains("`outbox cancel QUEUE TIMER_ID`"),
            "{}",
            text(&out.stderr)
        );
    }
    t.cleanup().await;
}

/// `outbox cancel QUEUE TIMER_ID` is the library's cancel: a pending timer's row is
/// deleted, a running one's is marked (deleted however its run ends), and a key no live
/// row holds is a failure (exit 1).
#[tokio::test]
async fn cancel_a_pending_and_a_running_timer() {
    let t = Tables::new().await;
    let mut conn = t.pool.acquire().await.unwrap();
    for key in ["pending", "running"] {
        t.outbox
            .publish(
                &mut conn,
                Message::new("cli.c", b"x")
                    .timer_id(key)
                    .schedule(Duration::from_secs(3600)),
            )
            .await
            .unwrap();
    }
    drop(conn);
    let out = t.run(&["cancel", "cli.c", "pending"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("timer pending of cli.c cancelled: pending row"),
        "{}",
        text(&out.stdout)
    );
    let out = t.run(&["cancel", "cli.c", "pending"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("no live row holds timer pending of cli.c"),
        "{}",
        text(&out.stderr)
    );
    // A row a worker holds: marked, not deleted.
    t.exec(format!(
        "UPDATE {} SET acquired_token = gen_random_uuid(), acquired_at = now() \
         WHERE timer_id = 'running'",
        t.outbox.table()
    ))
    .await;
    let done = t.json(&["cancel", "cli.c", "running"]);
    assert_eq!(done["result"], "running", "{done}");
    let marked: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {} WHERE timer_id = 'running' AND cancelled_at IS NOT NULL",
        t.outbox.table()
    )))
    .fetch_one(&t.pool)
    .await
    .unwrap();
    assert_eq!(marked, 1);
    t.cleanup().await;
}

#[tokio::test]
async fn permission_errors_say_which_grant_is_missing() {
    let t = Tables::new().await;
    let role = format!("{}_role", t.name);
    t.exec(format!(
        "CREATE ROLE {role} LOGIN; GRANT SELECT ON {} TO {role}",
        t.outbox.table()
    ))
    .await;
    let url = database_url();
    // The same server and database, as the new role (trust authentication).
    let rest = url.split_once('@').map_or(url.as_str(), |(_, r)| r);
    let as_role = format!("postgres://{role}@{rest}");
    let out = outbox_cmd()
        .args(["--database-url", &as_role, "--table", &t.name, "pause", "q"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("lacks a grant"), "{err}");
    assert!(
        err.contains(&format!("INSERT, DELETE on {}_paused", t.name)),
        "{err}"
    );
    assert!(
        err.contains("docs/guide/deployment.md#a-runtime-role-without-ddl-rights"),
        "{err}"
    );
    let name = t.name.clone();
    let pool = t.pool.clone();
    t.cleanup().await;
    sqlx::raw_sql(AssertSqlSafe(format!("DROP ROLE {role}")))
        .execute(&pool)
        .await
        .unwrap();
    let _ = name;
}

/// Every command through a real PgBouncer in transaction mode (the deployment guide's
/// settings) with `--transaction-pooler`: status, pending, pause and resume, the row
/// actions, the dead-letter commands and validate work; `migrate` refuses, naming the
/// direct connection to use (SPEC §13).
#[tokio::test]
async fn commands_run_through_pgbouncer_with_transaction_pooler() {
    let t = Tables::new().await;
    let bouncer = outbox_bench::pgbouncer::PgBouncer::start(&database_url());
    let through = |args: &[&str]| {
        outbox_cmd()
            .args(["--database-url", bouncer.url(), "--transaction-pooler"])
            .args(["--table", &t.name])
            .args(args)
            .output()
            .expect("the binary runs")
    };
    let json = |args: &[&str]| {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let out = through(&all);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        serde_json::from_slice::<Value>(&out.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {}", text(&out.stdout)))
    };
    let mut conn = t.pool.acquire().await.unwrap();
    let mut ids = Vec::new();
    for _ in 0..3 {
        let p = t
            .outbox
            .publish(
                &mut conn,
                Message::new("cli.pgb", b"x").schedule(Duration::from_secs(3600)),
            )
            .await
            .unwrap();
        ids.push(p.id().unwrap().to_string());
    }
    drop(conn);
    t.exec(format!(
        "INSERT INTO {} (original_id, queue, payload, attempts_count, deliveries_count, \
         created_at, failed_at, failure_reason) VALUES \
         (1, 'cli.pgb', 'dead', 1, 1, now(), now() - interval '2 hours', 'rejected')",
        t.outbox.dead_letter_table()
    ))
    .await;

    assert!(through(&["--dead-letter", "validate"]).status.success());
    assert_eq!(queue_of(&json(&["status"]), "cli.pgb")["pending"], 3);
    assert_eq!(
        json(&["pending", "cli.pgb"])["rows"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
    for args in [
        &["pause", "cli.pgb"][..],
        &["resume", "cli.pgb"],
        &["run-now", &ids[0]],
        &["reschedule", &ids[1], "--in", "2h"],
        &["delete", &ids[2]],
    ] {
        let out = through(args);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
    }
    let letters = json(&["dlq", "list"]);
    let id = letters["dead_letters"][0]["id"].to_string();
    assert_eq!(json(&["dlq", "redrive", "--id", &id])["redriven"], 1);
    assert_eq!(json(&["dlq", "purge", "--older-than", "1h"])["deleted"], 1);

    let out = through(&["migrate"]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    let err = text(&out.stderr);
    assert!(
        err.contains("without --transaction-pooler") && err.contains("server itself"),
        "{err}"
    );
    drop(bouncer);
}

/// The version gate through the binary: on a supported server `migrate` and `validate`
/// run; on one outside PostgreSQL 14 to 18 (13 in `.ci/run`'s version matrix) both exit 1
/// with the library's sentence naming the server's version, and nothing is created.
#[tokio::test]
async fn postgres_version_decides_whether_migrate_and_validate_run() {
    let t = Tables::with(true, false).await;
    let (version, num): (String, i32) = sqlx::query_as(
        "SELECT current_setting('server_version'), current_setting('server_version_num')::int",
    )
    .fetch_one(&t.pool)
    .await
    .unwrap();
    let (low, high) = outbox::schema::SUPPORTED_POSTGRES;
    let supported = (low..=high).contains(&u32::try_from(num / 10_000).unwrap());
    for args in [&["migrate"][..], &["validate"][..]] {
        let out = t.run(args);
        if supported {
            assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
            continue;
        }
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains(&format!(
                "PostgreSQL {version} is not supported: this version of outbox runs on \
                 PostgreSQL 14 to 18"
            )),
            "{args:?}: {stderr}"
        );
    }
    let created: Option<i64> = sqlx::query_scalar("SELECT to_regclass($1)::oid::bigint")
        .bind(&t.name)
        .fetch_one(&t.pool)
        .await
        .unwrap();
    assert_eq!(created.is_some(), supported, "PostgreSQL {version}");
    t.cleanup().await;
}

/// The commands against a Citus coordinator (`.ci/citus` points `DATABASE_URL` at one and
/// sets `OUTBOX_CITUS=1`); ignored in the ordinary run, run by `.ci/run`'s Citus step.
#[tokio::test]
#[ignore = "needs a Citus cluster: .ci/citus -- cargo nextest run --run-ignored only -E 'test(/citus/)'"]
async fn citus_commands_against_a_coordinator() {
    assert_eq!(
        std::env::var("OUTBOX_CITUS").as_deref(),
        Ok("1"),
        "run under .ci/citus"
    );
    let t = Tables::with(true, false).await;
    let d = ["--distributed", "16"];
    let with = |args: &[&str]| {
        let mut all = d.to_vec();
        all.extend_from_slice(args);
        all.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let run = |args: &[&str]| {
        let args = with(args);
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        t.run(&refs)
    };
    let out = run(&["migrate"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = run(&["--dead-letter", "validate"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Built with another bucket count: the check says so in Citus terms.
    let out = t.run(&["--distributed", "32", "validate"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stdout).contains("holds 16 buckets"),
        "{}",
        text(&out.stdout)
    );

    let distributed = Outbox::builder()
        .table(&t.name)
        .dead_letter(true)
        .distributed(16)
        .build()
        .unwrap();
    let mut conn = t.pool.acquire().await.unwrap();
    let outbox::Published::Inserted { id } = distributed
        .publish(&mut conn, Message::new("jobs", b"{}"))
        .await
        .unwrap()
    else {
        panic!("inserted")
    };
    drop(conn);
    let status = t.json(&["--distributed", "16", "status"]);
    assert_eq!(queue_of(&status, "jobs")["pending"], 1, "{status}");
    for args in [
        vec!["pending", "jobs"],
        vec!["pause", "jobs"],
        vec!["resume", "jobs"],
        vec!["run-now", &id.to_string()],
        vec!["delete", &id.to_string()],
        vec!["dlq", "list"],
    ] {
        let out = run(&args);
        assert!(
            out.status.success(),
            "{args:?}: {}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
    }
    t.exec(format!(
        "DROP TABLE IF EXISTS {}, {}_dlq, {}, {}",
        t.outbox.table(),
        t.name,
        t.outbox.migrations_table(),
        t.outbox.paused_table()
    ))
    .await;
}
/// Without basic auth, a loopback dashboard answers only requests addressed to a loopback
/// name: a page of another site that points its own name at 127.0.0.1 (DNS rebinding)
/// gets `421`, not the page and its form token. (Found by a fresh user: `Host: evil.com`
/// was served, and a POST with `Origin: http://evil.com` paused a queue.)
#[tokio::test]
async fn ui_on_loopback_without_auth_refuses_other_host_names() {
    let t = Tables::new().await;
    let (mut child, addr) = spawn_ui(&t, &["--listen", "127.0.0.1:0"]);
    let port = addr.rsplit(':').next().unwrap().to_owned();
    let get = |host: &str| {
        http(
            &addr,
            &format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"),
        )
    };
    for host in [format!("evil.example:{port}"), "evil.example".to_owned()] {
        let refused = get(&host);
        assert!(refused.starts_with("HTTP/1.1 421"), "{host}: {refused}");
        // The refusal carries the dashboard's security headers too.
        assert!(
            refused.contains("content-security-policy:") && refused.contains("x-frame-options:"),
            "{refused}"
        );
        assert!(!refused.contains("csrf"), "{refused}");
    }
    for host in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        format!("LOCALHOST:{port}"),
    ] {
        let page = get(&host);
        assert!(page.starts_with("HTTP/1.1 200"), "{host}: {page}");
    }
    let post = http(
        &addr,
        &format!("POST /queues/x/pause HTTP/1.1\r\nHost: evil.example:{port}\r\nOrigin: http://evil.example:{port}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 6\r\nConnection: close\r\n\r\ncsrf=x"),
    );
    assert!(post.starts_with("HTTP/1.1 421"), "{post}");
    child.kill().unwrap();
    let _ = child.wait();
    t.cleanup().await;
}

/// `--listen localhost:0` resolves the name and keeps the loopback-only Host check.
#[tokio::test]
async fn ui_listens_on_a_host_name() {
    let t = Tables::new().await;
    let (mut child, addr) = spawn_ui(&t, &["--listen", "localhost:0"]);
    let port = addr.rsplit(':').next().unwrap().to_owned();
    let page = http(
        &addr,
        &format!("GET / HTTP/1.1\r\nHost: localhost:{port}\r\nConnection: close\r\n\r\n"),
    );
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    let refused = http(
        &addr,
        &format!("GET / HTTP/1.1\r\nHost: evil.example:{port}\r\nConnection: close\r\n\r\n"),
    );
    assert!(refused.starts_with("HTTP/1.1 421"), "{refused}");
    child.kill().unwrap();
    let _ = child.wait();
    let bad = outbox_cmd()
        .args(["--table", &t.name, "ui", "--listen", "localhost"])
        .output()
        .expect("the binary runs");
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("bad --listen \"localhost\": no port"), "{err}");
    t.cleanup().await;
}

/// One HTTP/1.1 request over a plain socket; the whole response as text.
fn http(addr: &str, request: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("the dashboard listens");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[tokio::test]
async fn ui_serves_the_dashboard_behind_basic_auth_and_read_only() {
    let t = Tables::new().await;
    let mut conn = t.pool.acquire().await.unwrap();
    t.outbox
        .publish(&mut conn, Message::new("ui.<b>", b"{}"))
        .await
        .unwrap();
    drop(conn);
    let mut child = outbox_cmd()
        .args([
            "--table",
            &t.name,
            "--dead-letter",
            "ui",
            "--listen",
            "127.0.0.1:0",
        ])
        .args(["--read-only", "--basic-auth", "ops:s3:cret"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let addr = first
        .strip_prefix("outbox ui: http://")
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_else(|| panic!("the first line names the address: {first:?}"))
        .to_owned();
    assert!(first.contains("(read-only) (basic auth)"), "{first}");
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");

    let denied = http(
        &addr,
        "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert!(denied.starts_with("HTTP/1.1 401"), "{denied}");
    assert!(denied.contains("www-authenticate: Basic"), "{denied}");
    // ops:s3:cret in base64.
    let auth = "Authorization: Basic b3BzOnMzOmNyZXQ=\r\n";
    let page = http(
        &addr,
        &format!("GET / HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n"),
    );
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    // RFC 7235: the scheme is case-insensitive.
    let lower = http(
        &addr,
        "GET / HTTP/1.1\r\nHost: x\r\nauthorization: basic b3BzOnMzOmNyZXQ=\r\nConnection: close\r\n\r\n",
    );
    assert!(lower.starts_with("HTTP/1.1 200"), "{lower}");
    assert!(
        page.contains("ui.&lt;b&gt;") && !page.contains("ui.<b>"),
        "{page}"
    );
    assert!(
        page.contains("read-only") && !page.contains(r#"method="post""#),
        "{page}"
    );
    let post = http(
        &addr,
        &format!("POST /queues/x/pause HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 6\r\nConnection: close\r\n\r\ncsrf=x"),
    );
    assert!(post.starts_with("HTTP/1.1 403"), "{post}");
    child.kill().unwrap();
    child.wait().unwrap();

    // The error never repeats the value: a password in logs.
    for value in ["s3cretvalue", ":s3cretvalue", "s3cretvalue:"] {
        let bad = t.run(&["ui", "--basic-auth", value]);
        assert_eq!(bad.status.code(), Some(2), "{}", text(&bad.stderr));
        let err = text(&bad.stderr);
        assert!(err.contains("user:password"), "{err}");
        assert!(!err.contains("s3cretvalue"), "{err}");
        let bad = outbox_cmd()
            .args(["--table", &t.name, "ui"])
            .env("OUTBOX_UI_BASIC_AUTH", value)
            .output()
            .unwrap();
        assert_eq!(bad.status.code(), Some(2), "{}", text(&bad.stderr));
        assert!(
            !text(&bad.stderr).contains("s3cretvalue"),
            "{}",
            text(&bad.stderr)
        );
    }
    t.cleanup().await;
}

/// Starts `outbox ui` with `args`; the child and the address its first line prints.
fn spawn_ui(t: &Tables, args: &[&str]) -> (std::process::Child, String) {
    let mut child = outbox_cmd()
        .args(["--table", &t.name, "ui"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary runs");
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let addr = first
        .strip_prefix("outbox ui: http://")
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_else(|| panic!("the first line names the address: {first:?}"))
        .to_owned();
    (child, addr)
}

/// Every loopback address is loopback (127.0.0.2, an IPv4-mapped IPv6 one): the printed
/// address is served and other names get 421; a listener beyond this machine warns about
/// DNS rebinding and names --basic-auth; a port alone says the host is missing.
#[tokio::test]
async fn ui_knows_every_loopback_address_and_warns_beyond_it() {
    let t = Tables::new().await;
    let mut listens = vec!["127.0.0.2:0"];
    if std::net::TcpListener::bind("[::ffff:127.0.0.1]:0").is_ok() {
        listens.push("[::ffff:127.0.0.1]:0");
    }
    for listen in listens {
        let (mut child, addr) = spawn_ui(&t, &["--listen", listen]);
        let port = addr.rsplit(':').next().unwrap().to_owned();
        let get = |host: &str| {
            http(
                &addr,
                &format!("GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"),
            )
        };
        let page = get(&addr);
        assert!(page.starts_with("HTTP/1.1 200"), "{addr}: {page}");
        let refused = get(&format!("evil.example:{port}"));
        assert!(refused.starts_with("HTTP/1.1 421"), "{addr}: {refused}");
        child.kill().unwrap();
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        let _ = child.wait();
        assert!(!err.contains("warning"), "{listen}: {err}");
    }
    let (mut child, _) = spawn_ui(&t, &["--listen", "0.0.0.0:0", "--read-only"]);
    child.kill().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    let _ = child.wait();
    assert!(
        err.contains("DNS rebinding") && err.contains("--basic-auth"),
        "{err}"
    );
    let bad = t.run(&["ui", "--listen", "18736"]);
    assert!(
        text(&bad.stderr).contains("no host") && text(&bad.stderr).contains("127.0.0.1:18736"),
        "{}",
        text(&bad.stderr)
    );
    t.cleanup().await;
}

/// `--lease-ttl` is checked at startup against the workers' range (100 ms to 7 days), not
/// accepted and then failing every queues page.
#[tokio::test]
async fn ui_refuses_a_lease_ttl_no_worker_can_have() {
    let t = Tables::new().await;
    for ttl in ["99999999d", "8d", "10ms"] {
        let bad = t.run(&["ui", "--lease-ttl", ttl, "--listen", "127.0.0.1:0"]);
        assert_eq!(bad.status.code(), Some(2), "{ttl}: {}", text(&bad.stderr));
        assert!(
            text(&bad.stderr).contains("100ms to 7d"),
            "{}",
            text(&bad.stderr)
        );
    }
    t.cleanup().await;
}

/// `outbox ui` on tables that are not there refuses to start, with the migrate advice of
/// every other command, instead of serving pages that each fail.
#[tokio::test]
async fn ui_refuses_tables_that_are_not_migrated() {
    let finish = |mut child: std::process::Child| {
        let start = std::time::Instant::now();
        loop {
            if child.try_wait().unwrap().is_some() {
                break child.wait_with_output().unwrap();
            }
            if start.elapsed() > Duration::from_secs(20) {
                child.kill().unwrap();
                panic!("outbox ui started on tables that are not there");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let t = Tables::with(false, false).await;
    let out = finish(
        outbox_cmd()
            .args(["--table", &t.name, "ui", "--listen", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!("run `outbox --table {} migrate`", t.name)),
        "{err}"
    );
    t.cleanup().await;
    // Migrated without the dead-letter table, served with --dead-letter.
    let t = Tables::with(false, true).await;
    let out = finish(
        outbox_cmd()
            .args([
                "--table",
                &t.name,
                "--dead-letter",
                "ui",
                "--listen",
                "127.0.0.1:0",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let err = text(&out.stderr);
    assert!(err.contains("migrate --dead-letter`"), "{err}");
    t.cleanup().await;
}

/// An argument that is not UTF-8 is a usage error (exit 2), with or without `--json`,
/// never a panic (found by the fresh-user trial of 2026-12-05: `outbox pause $'\xff'`
/// panicked in the look for `--json`, exit 101).
#[test]
fn an_argument_that_is_not_utf8_is_a_usage_error() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;

    let bad = OsStr::from_bytes(b"\xff");
    for args in [
        vec![OsStr::new("pause"), bad],
        vec![bad],
        vec![OsStr::new("--json"), OsStr::new("pause"), bad],
        vec![OsStr::new("pause"), bad, OsStr::new("--json")],
    ] {
        let out = outbox_cmd().args(&args).output().unwrap();
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}
