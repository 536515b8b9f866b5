//! The presence example under a shortened load, on real Postgres (issue 6, req. 4): 200
//! users for 20 s with a 2 s timeout, some pinging steadily, some going silent, some
//! logging out, and some whose pings are timed to land while the expiry handler runs.
//!
//! Postgres comes from `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`).
//! The tables have unique names, so this runs next to the other test suites. If Postgres
//! cannot be reached the test fails with a message saying how to start it.

use sqlx::AssertSqlSafe;
use std::collections::BTreeSet;
use std::time::Duration;

use outbox::Outbox;
use presence::server::connect;
use presence::telemetry::Scrape;
use presence::{LoadConfig, Server, ServerConfig};

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_wrong_transitions_under_load_with_pings_during_expiry() {
    let stats = run(Duration::ZERO).await;
    assert_eq!(
        stats.rearmed_by_handler, 0,
        "without a slack a ping's extend queues every rearm: {stats:#?}"
    );
}

/// Issue 14: pings extend with a slack of 1.5 s (75 % of the timeout, more than the
/// demo's default, so steady users' timers do fire early): pings within the slack write
/// nothing, the expiry handler finds those users active and re-arms their timers, and
/// still no transition is wrong and no online user is left without a timer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_wrong_transitions_with_an_extend_slack() {
    let stats = run(Duration::from_millis(1500)).await;
    assert!(
        stats.pings_unchanged >= 100,
        "pings within the slack: {stats:#?}"
    );
    assert!(
        stats.rearmed_by_handler >= 10,
        "timers that fired early and were re-armed by the handler: {stats:#?}"
    );
}

/// The load and every check of a run; returns the server's final stats.
async fn run(slack: Duration) -> presence::server::Stats {
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..12];
    let users_table = format!("presence_users_{suffix}");
    let outbox = Outbox::builder()
        .table(format!("presence_t_{suffix}"))
        .build()
        .expect("valid table name");
    let mut config = ServerConfig::new(database_url());
    config.listen = ([127, 0, 0, 1], 0).into();
    config.timeout = Duration::from_secs(2);
    config.slack = slack;
    // Simulated work in the expiry handler: pings timed at the timeout land during it.
    config.handler_delay = Duration::from_millis(50);
    config.outbox = outbox.clone();
    config.users_table = users_table.clone();
    let server = match Server::start(config).await {
        Ok(s) => s,
        Err(e) => panic!("the presence service did not start (this test does not skip):\n{e}"),
    };

    let mut load = LoadConfig::new(server.url());
    load.users = 200;
    load.duration = Duration::from_secs(20);
    load.first_user_id = 1;
    load.edge = 0.2;
    load.silent = 0.15;
    load.logout = 0.15;
    load.observe_per_sec = 100;
    if let Some(seed) = std::env::var("PRESENCE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        load.seed = seed;
    }
    let report = presence::load::run(load).await;
    let audit = server.audit(1, 200).await;
    // What a Prometheus scrape gets after the run.
    let scraped = match reqwest::get(format!("{}/metrics", server.url())).await {
        Ok(r) => (
            r.status(),
            r.headers().get("content-type").cloned(),
            r.text().await,
        ),
        Err(e) => panic!("GET /metrics: {e}"),
    };
    server.shutdown().await;

    let cleanup = connect(&database_url(), 1)
        .await
        .expect("cleanup connection");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS \"{users_table}\", {}, {}, {}, {}",
        outbox.table(),
        outbox.dead_letter_table(),
        outbox.migrations_table(),
        outbox.paused_table()
    )))
    .execute(&cleanup)
    .await
    .expect("drop the test's tables");

    let report = report.expect("the load ran");
    println!("{}", report.summary());
    let audit = audit.expect("audit");
    let stats = report.server.clone().expect("final stats");

    assert_eq!(
        report.errors, 0,
        "failed requests: {:?}",
        report.error_samples
    );
    assert!(
        report.wrong.is_empty(),
        "wrong transitions: {:#?}",
        report.wrong
    );
    // Every steady user online, every silent and edge user offline (expired), every
    // logged-out user offline (logout), read over HTTP at the end.
    assert!(
        report.final_failures.is_empty(),
        "final states: {:#?}",
        report.final_failures
    );
    let online: BTreeSet<i64> = audit.online.iter().copied().collect();
    let steady: BTreeSet<i64> = report.steady.iter().copied().collect();
    assert_eq!(
        online, steady,
        "online users in the database are exactly the steady users"
    );
    // A lost rearm would leave an online user without a timer, online for ever.
    assert!(
        audit.online_without_timer.is_empty(),
        "online without a timer: {:?}",
        audit.online_without_timer
    );
    assert!(
        audit.logged_out_with_timer.is_empty(),
        "logged out with a live timer row: {:?}",
        audit.logged_out_with_timer
    );
    // The hard case happened, and often: pings landed while expiry handlers ran, queued
    // rearms, and the worker applied them.
    assert!(
        stats.pings_rearm_queued >= 10,
        "too few pings landed during a handler run: {stats:#?}"
    );
    assert!(
        stats.rearms_applied.unwrap_or(0) >= 10,
        "rearms applied: {stats:#?}"
    );
    assert!(
        stats.kept_online >= 10,
        "handlers that found a newer ping: {stats:#?}"
    );
    assert_eq!(stats.handler_errors, 0, "{stats:#?}");
    assert_eq!(stats.lease_lost, Some(0), "{stats:#?}");
    assert!(!report.silent.is_empty() && !report.edge.is_empty() && !report.logout.is_empty());

    // GET /metrics is the exporter's text: described metrics (HELP and TYPE lines from the
    // library's descriptions), the worker's counters, the lateness summary of the queue.
    let (status, content_type, text) = scraped;
    let text = text.expect("GET /metrics body");
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        content_type.as_ref().and_then(|v| v.to_str().ok()),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    for line in [
        "# HELP outbox_acked_total Successful runs whose fenced completion committed, by queue",
        "# TYPE outbox_acked_total counter",
        "# HELP outbox_firing_lateness_seconds Claim time minus deadline of each delivery, by queue",
        "# TYPE outbox_firing_lateness_seconds summary",
    ] {
        assert!(text.lines().any(|l| l == line), "no `{line}` in:\n{text}");
    }
    let scrape = Scrape::parse(&text);
    let acked = scrape
        .samples
        .iter()
        .find(|s| s.name == "outbox_acked_total" && s.label("queue") == Some("presence.expiry"));
    assert!(
        acked.is_some_and(|s| s.value >= 1.0),
        "outbox_acked_total of the queue: {acked:?}\n{text}"
    );
    // /stats reads the same exporter: its lateness is that summary's.
    let lateness = stats.lateness.expect("lateness in /stats");
    assert!(lateness.count >= 1 && lateness.max_ms > 0.0, "{lateness:?}");
    assert!(
        lateness.p50_ms <= lateness.p99_ms && lateness.p99_ms <= lateness.max_ms,
        "{lateness:?}"
    );
    assert!(
        scrape.counter("outbox_rearmed_total") >= stats.rearms_applied.unwrap_or(0),
        "counters only grow between /stats and /metrics: {stats:#?}\n{text}"
    );
    stats
}
