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
        let name = format!("cli_{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .connect(&database_url())
            .await
            .unwrap_or_else(|e| panic!("Postgres at DATABASE_URL must be reachable: {e}"));
        let outbox = Outbox::builder()
            .table(&name)
            .dead_letter(true)
            .build()
            .unwrap();
        outbox.migrate(&pool).await.unwrap();
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
        self.exec(format!(
            "DROP TABLE IF EXISTS {}, {}, {}, {}",
            self.outbox.table(),
            self.outbox.dead_letter_table(),
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
    assert_eq!(t.json(&["validate"])["ok"], true);
    let out = t.run(&["validate"]);
    assert!(text(&out.stdout).contains("is valid"));

    // A missing piece: listed, exit status 1, and the fix named.
    t.exec(format!("DROP TABLE {}", t.outbox.paused_table()))
        .await;
    let out = t.run(&["validate"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stdout).contains(&format!("{}_paused: table is missing", t.name)),
        "{}",
        text(&out.stdout)
    );
    assert!(
        text(&out.stderr).contains("run `outbox migrate`"),
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

    let pending = t.json(&["pending", "--queue", "cli.q"]);
    let rows = pending["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    assert_eq!(rows[0]["payload"], "a");
    assert_eq!(rows[2]["timer_id"], "k");
    assert_eq!(rows[2]["state"], "pending");
    let table = text(
        &t.run(&["pending", "--queue", "cli.q", "--limit", "2"])
            .stdout,
    );
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
    let live = t.json(&["pending", "--queue", "cli.q"]);
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
        .args(["--table", "cli_never_migrated", "pending", "--queue", "q"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("run `outbox migrate`"), "{err}");

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
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("queue"), "{}", text(&out.stderr));
    let out = t.run(&["dlq", "list", "--reason", "nope"]);
    assert!(
        text(&out.stderr).contains("use one of max_deliveries, retry_exhausted"),
        "{}",
        text(&out.stderr)
    );
    let out = t.run(&["dlq", "redrive"]);
    assert!(
        text(&out.stderr).contains("--id N"),
        "{}",
        text(&out.stderr)
    );
    let out = t.run(&["status", "--lease-ttl", "soon"]);
    assert_eq!(out.status.code(), Some(2), "a usage error");
    let long = "x".repeat(70);
    let out = outbox_cmd()
        .args(["--table", &long, "status"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("63 bytes"),
        "{}",
        text(&out.stderr)
    );
    t.cleanup().await;
}
