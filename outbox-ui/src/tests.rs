//! The router against real Postgres (`DATABASE_URL`, default the `test` database on
//! 127.0.0.1): escaping, the CSRF and origin guard, read-only mode, the actions and their
//! refusals, keyset pagination, and every statement's plan (SPEC §15). Each test makes its
//! own uniquely named tables and drops them.

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use axum::Router;
use outbox::Message;
use outbox::Outbox;
use serde_json::Value;
use sqlx::{AssertSqlSafe, PgPool};
use tower::ServiceExt;

use crate::sql::{StateFilter, Statements};
use crate::Dashboard;

const HOST: &str = "dash.test";

struct Db {
    pool: PgPool,
    outbox: Outbox,
}

impl Db {
    async fn new() -> Db {
        let url = std::env::var("DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
        let pool = PgPool::connect(&url).await.unwrap_or_else(|e| {
            panic!("cannot reach Postgres at {url} ({e}): start it, or set DATABASE_URL")
        });
        let table = format!("ui_t_{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
        let outbox = Outbox::builder()
            .table(&table)
            .dead_letter(true)
            .build()
            .unwrap();
        outbox.migrate(&pool).await.expect("migrate");
        Db { pool, outbox }
    }

    fn router(&self, read_only: bool, page_size: usize) -> Router {
        let d = Dashboard::new(self.outbox.clone(), self.pool.clone())
            .unwrap()
            .read_only(read_only)
            .page_size(page_size)
            .unwrap();
        Router::new().nest("/outbox", d.router())
    }

    async fn exec(&self, sql: String) {
        sqlx::query(AssertSqlSafe(sql))
            .execute(&self.pool)
            .await
            .unwrap();
    }

    async fn publish(&self, queue: &str, payload: &[u8], timer: Option<&str>, delay: u64) -> i64 {
        let mut conn = self.pool.acquire().await.unwrap();
        let mut m = Message::new(queue, payload).schedule(Duration::from_secs(delay));
        if let Some(t) = timer {
            m = m.timer_id(t);
        }
        self.outbox
            .publish(&mut conn, m)
            .await
            .unwrap()
            .id()
            .unwrap()
    }

    async fn drop_tables(self) {
        let o = &self.outbox;
        self.exec(format!(
            "DROP TABLE IF EXISTS {}, {}, {}, {} CASCADE",
            o.table(),
            o.dead_letter_table(),
            o.paused_table(),
            o.migrations_table()
        ))
        .await;
    }
}

async fn get(router: &Router, path: &str) -> (StatusCode, String) {
    let r = router
        .clone()
        .oneshot(
            Request::get(path)
                .header(header::HOST, HOST)
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    let status = r.status();
    let body = axum::body::to_bytes(r.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

/// A form POST as a browser on the dashboard's page sends it; `origin` None leaves the
/// header out. Returns the status and the `Location` (or body).
async fn post(
    router: &Router,
    path: &str,
    form: &str,
    origin: Option<&str>,
) -> (StatusCode, String) {
    let mut b = Request::post(path)
        .header(header::HOST, HOST)
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
    if let Some(o) = origin {
        b = b.header(header::ORIGIN, o);
    }
    let r = router
        .clone()
        .oneshot(b.body(Body::from(form.to_owned())).unwrap())
        .await
        .unwrap();
    let status = r.status();
    let location = r
        .headers()
        .get(header::LOCATION)
        .map(|l| l.to_str().unwrap().to_owned());
    let body = axum::body::to_bytes(r.into_body(), usize::MAX)
        .await
        .unwrap();
    (
        status,
        location.unwrap_or_else(|| String::from_utf8(body.to_vec()).unwrap()),
    )
}

/// The token the pages embed.
fn token(page: &str) -> String {
    let at = page
        .find(r#"name="csrf" value=""#)
        .expect("a form with the token")
        + 19;
    page[at..at + 64].to_owned()
}

/// The notice a redirect carries, decoded.
fn notice(location: &str) -> String {
    let q = location.split_once('?').map_or("", |(_, q)| q);
    let raw = q
        .split('&')
        .find_map(|kv| kv.strip_prefix("ok=").or_else(|| kv.strip_prefix("error=")))
        .unwrap_or("");
    let bytes = raw.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            out.push(u8::from_str_radix(&raw[i + 1..i + 3], 16).unwrap());
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap()
}

const ORIGIN: Option<&str> = Some("http://dash.test");

#[tokio::test]
async fn every_database_value_is_escaped() {
    let db = Db::new().await;
    let id = db
        .publish(
            "q<script>",
            br#"{"x":"<script>alert(1)</script>"}"#,
            Some("<img src=x onerror=alert(2)>"),
            60,
        )
        .await;
    db.exec(format!(
        "UPDATE {} SET headers = '{{\"h\": \"<script>alert(3)</script>\"}}' WHERE id = {id}",
        db.outbox.table()
    ))
    .await;
    db.exec(format!(
        "INSERT INTO {} (original_id, queue, payload, attempts_count, deliveries_count, \
         created_at, failure_reason, last_error) VALUES (1, 'q<script>', '\\x3c7363726970743e', \
         1, 1, now(), 'rejected', '<script>alert(4)</script>')",
        db.outbox.dead_letter_table()
    ))
    .await;
    let r = db.router(false, 50);
    for path in [
        "/outbox".to_owned(),
        "/outbox/queues/q%3Cscript%3E".to_owned(),
        format!("/outbox/rows/{id}"),
        "/outbox/dead-letters".to_owned(),
    ] {
        let (status, body) = get(&r, &path).await;
        assert_eq!(status, StatusCode::OK, "{path}: {body}");
        assert!(
            !body.contains("<script>alert"),
            "{path} shows a raw script: {body}"
        );
        assert!(
            !body.contains("<img src=x"),
            "{path} shows a raw tag: {body}"
        );
        assert!(
            !body.contains("q<script>"),
            "{path} shows the raw queue name"
        );
        assert!(
            body.contains("q&lt;script&gt;"),
            "{path} lacks the escaped queue name"
        );
    }
    let (_, row) = get(&r, &format!("/outbox/rows/{id}")).await;
    assert!(
        row.contains("&lt;script&gt;alert(1)&lt;/script&gt;"),
        "{row}"
    );
    assert!(
        row.contains("&lt;script&gt;alert(3)&lt;/script&gt;"),
        "{row}"
    );
    let (_, dl) = get(&r, "/outbox/dead-letters").await;
    assert!(dl.contains("&lt;script&gt;alert(4)&lt;/script&gt;"), "{dl}");
    db.drop_tables().await;
}

#[tokio::test]
async fn actions_need_the_token_the_same_origin_and_a_writable_dashboard() {
    let db = Db::new().await;
    db.publish("mail", b"{}", None, 60).await;
    let r = db.router(false, 50);
    let (_, page) = get(&r, "/outbox").await;
    let t = token(&page);
    let mut conn = db.pool.acquire().await.unwrap();

    let (status, _) = post(&r, "/outbox/queues/mail/pause", "csrf=wrong", ORIGIN).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, _) = post(&r, "/outbox/queues/mail/pause", "", ORIGIN).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, body) = post(
        &r,
        "/outbox/queues/mail/pause",
        &format!("csrf={t}"),
        Some("http://evil.example"),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(body.contains("another site"), "{body}");
    assert!(
        db.outbox.paused_queues(&mut conn).await.unwrap().is_empty(),
        "a refused POST paused"
    );

    let (status, location) = post(
        &r,
        "/outbox/queues/mail/pause",
        &format!("csrf={t}"),
        ORIGIN,
    )
    .await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert_eq!(notice(&location), "mail: paused");
    assert!(location.starts_with("/outbox?"), "{location}");
    assert_eq!(db.outbox.paused_queues(&mut conn).await.unwrap().len(), 1);
    let (_, location) = post(
        &r,
        "/outbox/queues/nothing/pause",
        &format!("csrf={t}"),
        None,
    )
    .await;
    assert_eq!(
        notice(&location),
        "nothing: paused (no rows in it now: check the name)"
    );
    let (_, location) = post(
        &r,
        "/outbox/queues/mail/resume",
        &format!("csrf={t}"),
        ORIGIN,
    )
    .await;
    assert_eq!(notice(&location), "mail: running");

    // A bad name is the library's typed error, shown; nothing changes.
    let long = "q".repeat(300);
    let (status, location) = post(
        &r,
        &format!("/outbox/queues/{long}/resume"),
        &format!("csrf={t}"),
        ORIGIN,
    )
    .await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert!(location.contains("error="), "{location}");

    // The redirect goes back to the form's page, never off the site.
    for (referer, expected) in [
        (
            "http://dash.test/outbox/queues/mail?state=due&ok=old",
            "/outbox/queues/mail?state=due&ok=",
        ),
        ("http://dash.test//evil.example/outbox/", "/outbox?ok="),
        ("http://dash.test/elsewhere", "/outbox?ok="),
    ] {
        let response = r
            .clone()
            .oneshot(
                Request::post("/outbox/queues/mail/resume")
                    .header(header::HOST, HOST)
                    .header(header::REFERER, referer)
                    .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
                    .body(Body::from(format!("csrf={t}")))
                    .unwrap(),
            )
            .await
            .unwrap();
        let location = response.headers()[header::LOCATION].to_str().unwrap();
        assert!(location.starts_with(expected), "{referer} -> {location}");
    }

    // Read-only: no form, every POST refused, even with a token.
    let ro = db.router(true, 50);
    for path in ["/outbox", "/outbox/queues/mail", "/outbox/dead-letters"] {
        let (_, body) = get(&ro, path).await;
        assert!(
            !body.contains(r#"method="post""#),
            "{path} has a form: {body}"
        );
        assert!(body.contains("read-only"), "{path}");
    }
    let (status, body) = post(
        &ro,
        "/outbox/queues/mail/pause",
        &format!("csrf={t}"),
        ORIGIN,
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(body.contains("read-only"), "{body}");
    db.drop_tables().await;
}

#[tokio::test]
async fn row_actions_follow_the_library_and_never_touch_a_held_row() {
    let db = Db::new().await;
    let pending = db.publish("jobs", b"{}", None, 3600).await;
    let held = db.publish("jobs", b"{}", Some("k1"), 0).await;
    db.exec(format!(
        "UPDATE {} SET acquired_token = gen_random_uuid(), acquired_at = now() WHERE id = {held}",
        db.outbox.table()
    ))
    .await;
    let r = db.router(false, 50);
    let (_, page) = get(&r, &format!("/outbox/rows/{pending}")).await;
    let t = token(&page);
    let (_, page) = get(&r, &format!("/outbox/rows/{held}")).await;
    assert!(page.contains("A worker holds this row"), "{page}");
    assert!(!page.contains("Run now"), "an action on a held row: {page}");

    let (_, location) = post(
        &r,
        &format!("/outbox/rows/{held}/run-now"),
        &format!("csrf={t}"),
        ORIGIN,
    )
    .await;
    assert!(
        notice(&location).starts_with(&format!("row {held} is leased")),
        "{location}"
    );
    let (_, location) = post(
        &r,
        "/outbox/queues/jobs/cancel",
        &format!("csrf={t}&timer_id=k1&confirm=yes"),
        ORIGIN,
    )
    .await;
    assert!(
        notice(&location).contains("a worker holds its row"),
        "{location}"
    );
    let still: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {} WHERE id = {held} AND cancelled_at IS NULL",
        db.outbox.table()
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(still, 1, "the held row was touched");

    let (_, location) = post(
        &r,
        &format!("/outbox/rows/{pending}/reschedule"),
        &format!("csrf={t}&in=soon"),
        ORIGIN,
    )
    .await;
    assert!(
        notice(&location).starts_with("bad delay (") && notice(&location).contains("soon"),
        "{location}"
    );
    // Months and years are refused, as by the library and the `outbox` command (`1M` is one
    // letter from `1m`; a fresh-user trial found `1y` moved a row by 365.25 days here).
    for calendar in ["1y", "1M", "2months"] {
        let (_, location) = post(
            &r,
            &format!("/outbox/rows/{pending}/reschedule"),
            &format!("csrf={t}&in={calendar}"),
            ORIGIN,
        )
        .await;
        assert!(
            notice(&location).starts_with("bad delay (")
                && notice(&location).contains("calendar unit"),
            "{calendar}: {location}"
        );
    }
    let (_, location) = post(
        &r,
        &format!("/outbox/rows/{pending}/reschedule"),
        &format!("csrf={t}&in=5m"),
        ORIGIN,
    )
    .await;
    assert!(
        notice(&location).starts_with(&format!("row {pending}: due at ")),
        "{location}"
    );
    let (_, location) = post(
        &r,
        &format!("/outbox/rows/{pending}/run-now"),
        &format!("csrf={t}"),
        ORIGIN,
    )
    .await;
    assert!(
        notice(&location).starts_with(&format!("row {pending}: due at ")),
        "{location}"
    );
    // Delete asks first (a page whose form confirms); the question changes nothing.
    let (status, page) = post(
        &r,
        &format!("/outbox/rows/{pending}/delete"),
        &format!("csrf={t}"),
        ORIGIN,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        page.contains(&format!("Delete row {pending}?"))
            && page.contains(r#"name="confirm" value="yes""#),
        "{page}"
    );
    let (status, _) = get(&r, &format!("/outbox/rows/{pending}")).await;
    assert_eq!(status, StatusCode::OK, "the question deleted the row");
    let (_, location) = post(
        &r,
        &format!("/outbox/rows/{pending}/delete"),
        &format!("csrf={t}&confirm=yes"),
        ORIGIN,
    )
    .await;
    assert_eq!(
        notice(&location),
        format!("row {pending}: deleted; it will not run")
    );
    let (_, location) = post(
        &r,
        &format!("/outbox/rows/{pending}/delete"),
        &format!("csrf={t}&confirm=yes"),
        ORIGIN,
    )
    .await;
    assert!(
        notice(&location).starts_with(&format!("no live row has id {pending}")),
        "{location}"
    );
    let (status, _) = get(&r, &format!("/outbox/rows/{pending}")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = get(&r, "/outbox/rows/-3").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    let free = db.publish("jobs", b"{}", Some("k2"), 600).await;
    // A form field that is not UTF-8 (`k2` and a stray byte, which axum would read as
    // "k2\u{fffd}") is refused before the action: the timer stays.
    let (status, page) = post(
        &r,
        "/outbox/queues/jobs/cancel",
        &format!("csrf={t}&timer_id=k2%FF&confirm=yes"),
        ORIGIN,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{page}");
    assert!(
        page.contains("the form holds a value that is not UTF-8"),
        "{page}"
    );
    let (_, location) = post(
        &r,
        "/outbox/queues/jobs/cancel",
        &format!("csrf={t}&timer_id=k2&confirm=yes"),
        ORIGIN,
    )
    .await;
    assert_eq!(
        notice(&location),
        format!("timer \"k2\" of jobs cancelled: row {free} deleted")
    );
    db.drop_tables().await;
}

#[tokio::test]
async fn queue_pages_are_keyset_paginated_filtered_and_searched() {
    let db = Db::new().await;
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(
            db.publish("pages", b"{}", Some(&format!("t{i}")), 10 * (i + 1))
                .await,
        );
    }
    let due = db.publish("pages", b"{}", None, 0).await;
    let r = db.router(false, 2);
    let (_, first) = get(&r, "/outbox/queues/pages").await;
    let next = first.split(r#"rel="next""#).next().unwrap();
    let href = next
        .rsplit(r#"href=""#)
        .next()
        .unwrap()
        .split('"')
        .next()
        .unwrap()
        .replace("&amp;", "&");
    assert!(
        first.contains(&format!("/outbox/rows/{due}"))
            && first.contains(&format!("/outbox/rows/{}", ids[0]))
    );
    let (_, second) = get(&r, &href).await;
    assert!(
        second.contains(&format!("/outbox/rows/{}", ids[1]))
            && second.contains(&format!("/outbox/rows/{}", ids[2])),
        "{second}"
    );
    assert!(
        !second.contains(&format!("/outbox/rows/{due}\"")),
        "the second page repeats the first"
    );
    let (_, only_due) = get(&r, "/outbox/queues/pages?state=due").await;
    assert!(
        only_due.contains(&format!("/outbox/rows/{due}"))
            && !only_due.contains(&format!("/outbox/rows/{}\"", ids[0]))
    );
    let (status, body) = get(&r, "/outbox/queues/pages?state=bogus").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body.contains("unknown state"), "{body}");
    let (status, _) = get(&r, "/outbox/queues/pages?after=garbage").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    let found = r
        .clone()
        .oneshot(
            Request::get("/outbox/queues/pages?q=t3")
                .header(header::HOST, HOST)
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(found.status(), StatusCode::SEE_OTHER);
    assert_eq!(
        found.headers()[header::LOCATION],
        format!("/outbox/rows/{}", ids[3]).as_str()
    );
    let by_id = r
        .clone()
        .oneshot(
            Request::get(format!("/outbox/queues/pages?q={due}"))
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(
        by_id.headers()[header::LOCATION],
        format!("/outbox/rows/{due}").as_str()
    );
    let (_, missing) = get(&r, "/outbox/queues/pages?q=nope").await;
    assert!(
        missing.contains("no live row of pages has the id or timer id"),
        "{missing}"
    );
    db.drop_tables().await;
}

#[tokio::test]
async fn purge_asks_first_and_redrive_follows_the_cli_rules() {
    let db = Db::new().await;
    let dlq = db.outbox.dead_letter_table().to_owned();
    db.exec(format!(
        "INSERT INTO {dlq} (original_id, queue, payload, timer_id, attempts_count, \
         deliveries_count, created_at, failed_at, failure_reason) VALUES \
         (1, 'a', '\\x7b7d', NULL, 1, 1, now(), now() - interval '2 days', 'rejected'), \
         (2, 'a', '\\x7b7d', 'held', 1, 1, now(), now(), 'timeout')"
    ))
    .await;
    db.publish("a", b"{}", Some("held"), 600).await;
    let r = db.router(false, 50);
    let (_, page) = get(&r, "/outbox/dead-letters?queue=a").await;
    let t = token(&page);
    let (status, body) = get(&r, "/outbox/dead-letters?reason=nope").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(body.contains("unknown failure reason"), "{body}");

    let (status, confirm) = post(
        &r,
        "/outbox/dead-letters/purge",
        &format!("csrf={t}&older_than=1d&queue=a"),
        ORIGIN,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        confirm.contains("Yes, purge") && confirm.contains("of queue a"),
        "{confirm}"
    );
    let count = |db: &Db| {
        let sql = format!("SELECT count(*) FROM {dlq}");
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql))
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(count(&db).await, 2, "the first POST deleted");
    let (_, location) = post(
        &r,
        "/outbox/dead-letters/purge",
        &format!("csrf={t}&older_than=1d&queue=a&confirm=yes"),
        ORIGIN,
    )
    .await;
    assert_eq!(
        notice(&location),
        "deleted 1 dead letter(s) of queue a older than 1day"
    );
    assert_eq!(count(&db).await, 1);
    let (_, location) = post(
        &r,
        "/outbox/dead-letters/purge",
        &format!("csrf={t}&older_than=later"),
        ORIGIN,
    )
    .await;
    assert!(notice(&location).starts_with("bad age"), "{location}");
    let (_, location) = post(
        &r,
        "/outbox/dead-letters/purge",
        &format!("csrf={t}&older_than=1y"),
        ORIGIN,
    )
    .await;
    assert!(
        notice(&location).starts_with("bad age (") && notice(&location).contains("calendar unit"),
        "{location}"
    );

    // The one left holds a timer key a live row has: kept, as the CLI reports it. Redrive
    // asks first.
    let (status, page) = post(
        &r,
        "/outbox/dead-letters/redrive",
        &format!("csrf={t}&queue=a&reason="),
        ORIGIN,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        page.contains("Redrive up to 50 dead letters not yet redriven of queue a"),
        "{page}"
    );
    let (_, location) = post(
        &r,
        "/outbox/dead-letters/redrive",
        &format!("csrf={t}&queue=a&reason=&confirm=yes"),
        ORIGIN,
    )
    .await;
    let n = notice(&location);
    assert!(
        n.contains("not redriven") && n.contains("a live row holds its timer key"),
        "{n}"
    );
    db.drop_tables().await;
}

#[tokio::test]
async fn the_schedules_page_lists_each_schedule_with_its_recurrence() {
    let db = Db::new().await;
    let t = db.outbox.table().to_owned();
    db.exec(format!(
        "INSERT INTO {t} (queue, payload, headers, timer_id, next_attempt_at, last_attempt_at) VALUES \
         ('reports', '\\x7b7d', '{{\"outbox-schedule\": \"every:300s\"}}', 'schedule:nightly', now() + interval '4 minutes', now() - interval '1 minute'), \
         ('reports', '\\x7b7d', '{{\"outbox-schedule\": \"cron:0 3 * * *@Europe/Paris\"}}', 'schedule:<b>x</b>', now() + interval '2 hours', NULL), \
         ('reports', '\\x7b7d', NULL, 'schedulex', now(), NULL), \
         ('mail', '\\x7b7d', NULL, 'plain-key', now(), NULL)"
    ))
    .await;
    let r = db.router(false, 50);
    let (status, page) = get(&r, "/outbox/schedules").await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(
        page.contains(">nightly<") && page.contains("every 5m"),
        "{page}"
    );
    assert!(page.contains("cron 0 3 * * * (Europe/Paris)"), "{page}");
    assert!(
        page.contains("&lt;b&gt;x&lt;/b&gt;") && !page.contains("<b>x</b>"),
        "{page}"
    );
    assert!(
        page.contains("(in 4 min)") && page.contains("(1 min ago)"),
        "{page}"
    );
    assert!(
        !page.contains("schedulex") && !page.contains("plain-key"),
        "not schedules: {page}"
    );
    db.drop_tables().await;
}

/// Every scan of the queue table in `plan`, with whether it is bounded by the index: an
/// index condition, or an index scan in its order under a `Limit` (the skip scan's first
/// probe reads one entry of a partial index).
fn scans(plan: &Value, parent: &str, table: &str, out: &mut Vec<(String, bool)>) {
    let kind = plan["Node Type"].as_str().unwrap_or("").to_owned();
    if plan.get("Relation Name").and_then(Value::as_str) == Some(table) && kind.ends_with("Scan") {
        let cond = ["Index Cond", "Recheck Cond"]
            .iter()
            .any(|k| plan.get(*k).is_some())
            || (kind.starts_with("Index") && parent == "Limit");
        out.push((kind.clone(), cond));
    }
    for c in plan
        .get("Plans")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        scans(c, &kind, table, out);
    }
}

/// A table of `rows` live rows over 8 queues (half due, one in `leased_every` leased, one in
/// 10 keyed) and `dead` dead letters, then VACUUM ANALYZE.
async fn fill(db: &Db, rows: i64, dead: i64, leased_every: i64) {
    let t = db.outbox.table();
    db.exec(format!(
        "INSERT INTO {t} (queue, payload, headers, next_attempt_at, timer_id, acquired_token, acquired_at) \
         SELECT 'q' || (i % 8), '\\x7b7d', '{{}}', now() + ((i % 2) * 2 - 1) * interval '1 hour' * random(), \
                CASE WHEN i % 10 = 0 THEN 'timer-' || i END, \
                CASE WHEN i % {leased_every} = 1 THEN gen_random_uuid() END, \
                CASE WHEN i % {leased_every} = 1 THEN now() - interval '30 seconds' END \
         FROM generate_series(1, {rows}) AS i"
    ))
    .await;
    db.exec(format!(
        "INSERT INTO {} (original_id, queue, payload, attempts_count, deliveries_count, created_at, \
         failed_at, failure_reason, last_error) \
         SELECT i, 'q' || (i % 8), '\\x7b7d', 3, 3, now(), now() - i * interval '1 second', \
                'retry_exhausted', 'boom' FROM generate_series(1, {dead}) AS i",
        db.outbox.dead_letter_table()
    ))
    .await;
    db.exec(format!("VACUUM ANALYZE {t}")).await;
    db.exec(format!("VACUUM ANALYZE {}", db.outbox.dead_letter_table()))
        .await;
}

#[tokio::test]
async fn every_statement_reaches_the_queue_table_through_an_index() {
    let db = Db::new().await;
    fill(&db, 100_000, 10_000, 100).await;
    let sql = Statements::render(&db.outbox);
    let table = db.outbox.table().trim_matches('"').to_owned();
    let after = chrono::Utc::now();
    let mut checked = Vec::new();
    for (i, filter) in StateFilter::EVERY.iter().enumerate() {
        checked.push((
            format!("list {}", filter.as_str()),
            sql.list[i].as_str().to_owned(),
            vec!["q3".into(), after.to_rfc3339(), "0".into(), "50".into()],
        ));
    }
    checked.push((
        "row".into(),
        sql.row.as_str().to_owned(),
        vec!["500".into()],
    ));
    checked.push((
        "by_timer".into(),
        sql.by_timer.as_str().to_owned(),
        vec!["q0".into(), "timer-80".into()],
    ));
    checked.push((
        "due".into(),
        sql.due.as_str().to_owned(),
        vec!["{q0,q1,q2,q3,q4,q5,q6,q7}".into(), "1001".into()],
    ));
    checked.push(("any".into(), sql.any.as_str().to_owned(), vec!["q1".into()]));
    checked.push((
        "schedules_range".into(),
        sql.schedules_range.as_str().to_owned(),
        vec!["500".into()],
    ));
    checked.push((
        "schedules_filter".into(),
        sql.schedules_filter.as_str().to_owned(),
        vec!["500".into()],
    ));
    for (name, text, params) in checked {
        // Parameters as text literals: the plan is that of the statement with its values.
        let mut s = text.clone();
        for (i, p) in params.iter().enumerate().rev() {
            s = s.replace(&format!("${}", i + 1), &format!("'{p}'"));
        }
        let plan: Value = sqlx::query_scalar(AssertSqlSafe(format!("EXPLAIN (FORMAT JSON) {s}")))
            .fetch_one(&db.pool)
            .await
            .unwrap_or_else(|e| panic!("EXPLAIN {name}: {e}\n{s}"));
        let mut found = Vec::new();
        scans(&plan[0]["Plan"], "", &table, &mut found);
        assert!(
            !found.is_empty(),
            "{name} does not read the queue table? {plan:#}"
        );
        assert!(
            found.iter().all(|(_, cond)| *cond),
            "{name} scans the queue table without an index condition: {found:?}\n{plan:#}"
        );
    }
    db.drop_tables().await;
}

/// Each page's time at scale: `OUTBOX_UI_ROWS` live rows (default 10⁶), one in
/// `OUTBOX_UI_LEASED_EVERY` (default 1000) leased, and a tenth as many dead letters. Prints
/// the median of 5 reads per page, after one warm-up read.
/// `cargo test --release -p outbox-ui -- --ignored --nocapture page_times_at_scale`.
#[tokio::test]
#[ignore = "a measurement: builds 10^6 rows (docs/lab-notes/2026-12-05-ui.md)"]
async fn page_times_at_scale() {
    let rows: i64 = std::env::var("OUTBOX_UI_ROWS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(1_000_000);
    let leased_every: i64 = std::env::var("OUTBOX_UI_LEASED_EVERY")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(1000);
    let db = Db::new().await;
    let started = Instant::now();
    fill(&db, rows, rows / 10, leased_every).await;
    println!(
        "filled {rows} rows and {} dead letters in {:?}",
        rows / 10,
        started.elapsed()
    );
    let r = db.router(false, 50);
    let some_id: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT max(id) FROM {}",
        db.outbox.table()
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let (_, page) = get(&r, "/outbox/queues/q3").await;
    let next = page
        .split(r#"rel="next""#)
        .next()
        .unwrap()
        .rsplit(r#"href=""#)
        .next()
        .unwrap()
        .split('"')
        .next()
        .unwrap()
        .replace("&amp;", "&");
    let (_, dl) = get(&r, "/outbox/dead-letters?queue=q5").await;
    let dl_next = dl
        .split(r#"rel="next""#)
        .next()
        .unwrap()
        .rsplit(r#"href=""#)
        .next()
        .unwrap()
        .split('"')
        .next()
        .unwrap()
        .replace("&amp;", "&");
    let pages = [
        "/outbox".to_owned(),
        "/outbox/queues/q3".to_owned(),
        next,
        "/outbox/queues/q3?state=due".to_owned(),
        "/outbox/queues/q3?state=leased".to_owned(),
        "/outbox/queues/q0?q=timer-800".to_owned(),
        format!("/outbox/rows/{some_id}"),
        "/outbox/dead-letters".to_owned(),
        "/outbox/dead-letters?queue=q5".to_owned(),
        dl_next,
        "/outbox/dead-letters?reason=retry_exhausted".to_owned(),
        "/outbox/schema".to_owned(),
    ];
    println!("| page | median ms | max ms |");
    for p in pages {
        let (status, _) = get(&r, &p).await;
        assert!(
            status.is_success() || status.is_redirection(),
            "{p}: {status}"
        );
        let mut times = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            get(&r, &p).await;
            times.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        times.sort_by(f64::total_cmp);
        println!("| `{p}` | {:.1} | {:.1} |", times[2], times[4]);
    }
    db.drop_tables().await;
}

#[tokio::test]
async fn a_notice_in_a_link_is_not_shown_unless_the_dashboard_signed_it() {
    let db = Db::new().await;
    db.publish("mail", b"{}", None, 60).await;
    let r = db.router(false, 50);
    let forged = "Queue purged, now run X";
    for path in [
        "/outbox?ok=Queue%20purged%2C%20now%20run%20X".to_owned(),
        "/outbox/queues/mail?error=Queue%20purged%2C%20now%20run%20X&sig=1.00".to_owned(),
        "/outbox/dead-letters?ok=Queue%20purged%2C%20now%20run%20X".to_owned(),
    ] {
        let (status, body) = get(&r, &path).await;
        assert_eq!(status, StatusCode::OK, "{path}");
        assert!(
            !body.contains(forged),
            "{path} shows a forged notice: {body}"
        );
    }
    // The redirect of a real action carries a signed notice, which its page shows once;
    // the same signature on other text is not shown.
    let (_, page) = get(&r, "/outbox").await;
    let t = token(&page);
    let (_, location) = post(
        &r,
        "/outbox/queues/mail/pause",
        &format!("csrf={t}"),
        ORIGIN,
    )
    .await;
    assert!(location.contains("&sig="), "{location}");
    let (_, body) = get(&r, &location).await;
    assert!(body.contains("mail: paused"), "{body}");
    let sig = location.split_once("&sig=").unwrap().1;
    let (_, body) = get(
        &r,
        &format!("/outbox?ok=Queue%20purged%2C%20now%20run%20X&sig={sig}"),
    )
    .await;
    assert!(
        !body.contains(forged),
        "a signature reused on other text: {body}"
    );
    // Another dashboard (another key) does not show it either.
    let other = db.router(false, 50);
    let (_, body) = get(&other, &location).await;
    assert!(!body.contains("mail: paused"), "{body}");
    db.drop_tables().await;
}

/// The figure in the "Finished/s" cell of `queue`'s row on the queues page.
/// Sets the counter's install instant `secs` seconds back.
async fn backdate_counter(db: &Db, secs: i64) {
    let c = crate::throughput::Names::of(&db.outbox).table;
    let at: f64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT extract(epoch FROM now())::float8 - {secs}"
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    db.exec(format!(
        "COMMENT ON TABLE {c} IS '{}{at}'",
        crate::throughput::INSTALLED_PREFIX
    ))
    .await;
}

fn finished_per_second(page: &str, queue: &str) -> Option<f64> {
    let row = page.find(&format!(">{queue}</a></th>"))?;
    let cell = row + page[row..].find(r#"class="num throughput">"#)? + 23;
    let end = cell + page[cell..].find(|c: char| c != '.' && !c.is_ascii_digit())?;
    page[cell..end].parse().ok()
}

#[tokio::test]
async fn the_throughput_counter_counts_each_queues_acks_of_a_real_worker() {
    let db = Db::new().await;
    let r = db.router(false, 50);
    // Off until installed: the page says how to turn it on.
    let (_, page) = get(&r, "/outbox").await;
    assert!(page.contains("--throughput-counter"), "{page}");
    let dashboard = Dashboard::new(db.outbox.clone(), db.pool.clone()).unwrap();
    dashboard.install_throughput_counter().await.unwrap();
    dashboard
        .install_throughput_counter()
        .await
        .expect("idempotent");
    // As if installed 10 minutes ago: a full window of counting.
    backdate_counter(&db, 600).await;

    const N: usize = 30;
    for _ in 0..N {
        db.publish("tp_a", b"{}", None, 0).await;
    }
    for _ in 0..3 {
        db.publish("tp_b", b"{}", None, 3600).await;
    }
    let worker = outbox::Worker::builder(outbox::PgStore::new(db.pool.clone(), db.outbox.clone()))
        .queue("tp_a", |_: Vec<u8>, _: outbox::Context| async {})
        .queue("tp_b", |_: Vec<u8>, _: outbox::Context| async {})
        .build()
        .unwrap()
        .start();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {} WHERE queue = 'tp_a'",
            db.outbox.table()
        )))
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the worker left {left} rows of tp_a"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = worker.shutdown().await;

    let counted: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT queue, sum(finished)::bigint FROM {} GROUP BY queue ORDER BY queue",
        crate::throughput::Names::of(&db.outbox).table
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(counted, vec![("tp_a".to_owned(), N as i64)]);

    // tp_a has no live row left and still has its row, with its rate; tp_b's is 0.
    let (_, page) = get(&r, "/outbox").await;
    let a = finished_per_second(&page, "tp_a").expect("tp_a's figure");
    let b = finished_per_second(&page, "tp_b").expect("tp_b's figure");
    assert!(a > 0.0, "tp_a: {a}\n{page}");
    assert_eq!(b, 0.0, "tp_b: {b}");
    assert!(!page.contains("--throughput-counter"), "still off: {page}");

    // A role that may delete queue rows but has no right on the counter table still
    // deletes (the trigger's function writes as its owner), and is counted.
    let role = format!("{}_role", db.outbox.table().trim_matches('"'));
    db.exec(format!("CREATE ROLE {role} NOLOGIN")).await;
    db.exec(format!(
        "GRANT SELECT, DELETE ON {} TO {role}",
        db.outbox.table()
    ))
    .await;
    let victim = db.publish("tp_b", b"{}", None, 3600).await;
    let mut tx = db.pool.begin().await.unwrap();
    sqlx::query(AssertSqlSafe(format!("SET LOCAL ROLE {role}")))
        .execute(&mut *tx)
        .await
        .unwrap();
    let deleted = sqlx::query(AssertSqlSafe(format!(
        "DELETE FROM {} WHERE id = {victim}",
        db.outbox.table()
    )))
    .execute(&mut *tx)
    .await
    .expect("a role without rights on the counter deletes");
    assert_eq!(deleted.rows_affected(), 1);
    tx.commit().await.unwrap();
    let b: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT coalesce(sum(finished), 0)::bigint FROM {} WHERE queue = 'tp_b'",
        crate::throughput::Names::of(&db.outbox).table
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(b, 1);
    db.exec(format!("REVOKE ALL ON {} FROM {role}", db.outbox.table()))
        .await;
    db.exec(format!("DROP ROLE {role}")).await;

    // The counter table dropped by hand, its trigger left: acks still delete.
    let counter = crate::throughput::Names::of(&db.outbox).table;
    db.exec(format!("DROP TABLE {counter}")).await;
    let orphan = db.publish("tp_b", b"{}", None, 3600).await;
    let deleted = sqlx::query(AssertSqlSafe(format!(
        "DELETE FROM {} WHERE id = {orphan}",
        db.outbox.table()
    )))
    .execute(&db.pool)
    .await
    .expect("a delete with the counter table gone");
    assert_eq!(deleted.rows_affected(), 1);
    dashboard.install_throughput_counter().await.unwrap();

    dashboard.remove_throughput_counter().await.unwrap();
    let (_, page) = get(&r, "/outbox").await;
    assert!(page.contains("--throughput-counter"), "{page}");
    let missing = Outbox::builder().table("ui_no_such_table").build().unwrap();
    let d = Dashboard::new(missing, db.pool.clone()).unwrap();
    assert!(matches!(
        d.install_throughput_counter().await,
        Err(crate::UiError::NoQueueTable { .. })
    ));
    db.drop_tables().await;
}

#[tokio::test]
#[ignore = "a measurement: WAL and time per ack batch with and without the throughput counter (docs/lab-notes/2026-12-05-ui.md)"]
async fn throughput_counter_cost() {
    let db = Db::new().await;
    let dashboard = Dashboard::new(db.outbox.clone(), db.pool.clone()).unwrap();
    let t = db.outbox.table().to_owned();
    const BATCHES: i64 = 200;
    for (counter, batch) in [
        (false, 100),
        (true, 100),
        (false, 100),
        (true, 100),
        (false, 1),
        (true, 1),
    ] {
        let batch: i64 = batch;
        if counter {
            dashboard.install_throughput_counter().await.unwrap();
        } else {
            dashboard.remove_throughput_counter().await.unwrap();
        }
        db.exec(format!(
            "INSERT INTO {t} (queue, payload, next_attempt_at, acquired_token, acquired_at) \
             SELECT 'q' || (i % 4), '\\x7b7d', now(), gen_random_uuid(), now() \
             FROM generate_series(1, {}) AS i",
            batch * BATCHES
        ))
        .await;
        db.exec(format!("VACUUM ANALYZE {t}")).await;
        let ids: Vec<i64> =
            sqlx::query_scalar(AssertSqlSafe(format!("SELECT id FROM {t} ORDER BY id")))
                .fetch_all(&db.pool)
                .await
                .unwrap();
        let mut conn = db.pool.acquire().await.unwrap();
        let before = wal_lsn(&mut conn).await;
        let started = Instant::now();
        for chunk in ids.chunks(batch as usize) {
            // The shape of the library's batched ack: one DELETE by ids, in its own
            // transaction.
            sqlx::query(AssertSqlSafe(format!(
                "DELETE FROM {t} WHERE id = ANY($1) AND acquired_token IS NOT NULL"
            )))
            .bind(chunk)
            .execute(&mut *conn)
            .await
            .unwrap();
        }
        let elapsed = started.elapsed();
        let wal = wal_lsn(&mut conn).await - before;
        println!(
            "counter {counter}: {BATCHES} batches of {batch} rows over 4 queues: \
             {:.0} WAL bytes per batch, {:.2} ms per batch",
            wal as f64 / BATCHES as f64,
            elapsed.as_secs_f64() * 1000.0 / BATCHES as f64
        );
    }
    dashboard.remove_throughput_counter().await.unwrap();
    db.drop_tables().await;
}

async fn wal_lsn(c: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint")
        .fetch_one(c)
        .await
        .unwrap()
}

#[tokio::test]
async fn an_expired_lease_is_shown_as_claimable_again_and_its_timer_can_be_cancelled() {
    let db = Db::new().await;
    let keyed = db.publish("exp", b"{}", Some("k-exp"), 0).await;
    let plain = db.publish("exp", b"{}", None, 0).await;
    let fresh = db.publish("exp", b"{}", Some("k-fresh"), 0).await;
    // Leases of 5 min ago (the dashboard's lease TTL is 60 s) and of now.
    db.exec(format!(
        "UPDATE {} SET acquired_token = gen_random_uuid(), acquired_at = now() - interval '5 minutes' \
         WHERE id IN ({keyed}, {plain})",
        db.outbox.table()
    ))
    .await;
    db.exec(format!(
        "UPDATE {} SET acquired_token = gen_random_uuid(), acquired_at = now() WHERE id = {fresh}",
        db.outbox.table()
    ))
    .await;
    let r = db.router(false, 50);
    let (_, page) = get(&r, "/outbox/queues/exp").await;
    assert_eq!(
        page.matches("lease expired 4 min ago: claimable again")
            .count(),
        2,
        "{page}"
    );
    assert_eq!(page.matches("held by a worker").count(), 1, "{page}");
    assert!(
        !page.contains("Run now"),
        "the library refuses a leased row: {page}"
    );
    let (_, page) = get(&r, &format!("/outbox/rows/{plain}")).await;
    assert!(page.contains("lease expired 4 min ago"), "{page}");
    assert!(
        page.contains("the next claim of its queue takes it again"),
        "{page}"
    );
    assert!(!page.contains("A worker holds this row"), "{page}");
    assert!(
        !page.contains("Run now") && !page.contains("Cancel timer"),
        "{page}"
    );
    let (_, page) = get(&r, &format!("/outbox/rows/{keyed}")).await;
    assert!(page.contains("Cancel timer"), "{page}");
    let t = token(&page);
    // run-now is refused by the library on any leased row, expired or not.
    let (_, location) = post(
        &r,
        &format!("/outbox/rows/{keyed}/run-now"),
        &format!("csrf={t}"),
        ORIGIN,
    )
    .await;
    assert!(notice(&location).contains("is leased"), "{location}");
    // The notice matches the row's page: the lease expired, the next claim takes it.
    assert!(
        notice(&location).contains("its lease expired")
            && notice(&location).contains("next claim")
            && !notice(&location).contains("a worker holds it"),
        "{location}"
    );
    let (_, location) = post(
        &r,
        "/outbox/queues/exp/cancel",
        &format!("csrf={t}&timer_id=k-exp&confirm=yes"),
        ORIGIN,
    )
    .await;
    assert!(
        notice(&location).contains("marked cancelled; the next claim deletes it"),
        "{location}"
    );
    let (_, location) = post(
        &r,
        "/outbox/queues/exp/cancel",
        &format!("csrf={t}&timer_id=k-fresh&confirm=yes"),
        ORIGIN,
    )
    .await;
    assert!(
        notice(&location).contains("a worker holds its row"),
        "{location}"
    );
    let marks: Vec<(i64, bool)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT id, cancelled_at IS NOT NULL FROM {} WHERE id IN ({keyed}, {fresh}) ORDER BY id",
        db.outbox.table()
    )))
    .fetch_all(&db.pool)
    .await
    .unwrap();
    assert_eq!(marks, vec![(keyed, true), (fresh, false)]);
    // Already marked: no second cancel offered.
    let (_, page) = get(&r, &format!("/outbox/rows/{keyed}")).await;
    assert!(!page.contains(">Cancel timer<"), "{page}");
    assert!(page.contains("already cancelled"), "{page}");
    db.drop_tables().await;
}

/// The `href` of the link whose text is `text` (HTML-escaped as the page writes it).
fn href_of(page: &str, text: &str) -> Option<String> {
    let end = page.find(&format!("\">{text}</a>"))?;
    let start = page[..end].rfind("href=\"")? + 6;
    Some(page[start..end].replace("&amp;", "&"))
}

#[tokio::test]
async fn every_queue_name_the_library_accepts_has_working_links() {
    let db = Db::new().await;
    let names = [
        ".", "..", "a/b", "../x", "q?x=1", "h#1", "50%", "sp ace", "a&b",
    ];
    for name in names {
        db.publish(name, b"{}", Some("k"), 3600).await;
    }
    let r = db.router(false, 50);
    let (_, page) = get(&r, "/outbox").await;
    let t = token(&page);
    for name in names {
        let escaped = maud::html! { (name) }.into_string();
        let href = href_of(&page, &escaped).unwrap_or_else(|| panic!("no link for {name:?}"));
        // What a browser does to a path: `.` and `..` segments are resolved away, also
        // percent-encoded ones. A link that survives is left as it is.
        assert!(href.starts_with("/outbox/queue?name="), "{name:?}: {href}");
        let (status, body) = get(&r, &href).await;
        assert_eq!(status, StatusCode::OK, "{name:?}: {href}");
        assert!(
            body.contains(&format!("<h1>Queue {escaped}</h1>")),
            "{name:?}: {href}: {body}"
        );
        assert!(body.contains(">k</td>"), "{name:?}'s row is listed: {body}");
        // Its actions carry the name the same way.
        let pause = format!("/outbox/queue/pause?{}", href.split_once('?').unwrap().1);
        assert!(
            body.contains(&format!("action=\"{}\"", pause.replace('&', "&amp;"))),
            "{name:?}: no form to {pause}: {body}"
        );
        let (status, location) = post(&r, &pause, &format!("csrf={t}"), ORIGIN).await;
        assert_eq!(status, StatusCode::SEE_OTHER, "{name:?}");
        assert_eq!(notice(&location), format!("{name}: paused"), "{name:?}");
    }
    let mut conn = db.pool.acquire().await.unwrap();
    let mut paused: Vec<String> = db
        .outbox
        .paused_queues(&mut conn)
        .await
        .unwrap()
        .into_iter()
        .map(|p| p.queue)
        .collect();
    paused.sort();
    let mut expected: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    expected.sort();
    assert_eq!(paused, expected);
    let (status, _) = get(&r, "/outbox/queue").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    db.drop_tables().await;
}

async fn download(router: &Router, path: &str) -> (StatusCode, axum::http::HeaderMap, Vec<u8>) {
    let r = router
        .clone()
        .oneshot(
            Request::get(path)
                .header(header::HOST, HOST)
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    let status = r.status();
    let headers = r.headers().clone();
    let body = axum::body::to_bytes(r.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, headers, body.to_vec())
}

#[tokio::test]
async fn a_large_payload_is_shown_in_part_and_downloaded_whole() {
    let db = Db::new().await;
    // 5 MB of JSON, and 1 MB of bytes that are not JSON.
    let json = format!("{{\"blob\":\"{}\"}}", "x".repeat(5 * 1024 * 1024));
    let id = db.publish("big", json.as_bytes(), None, 600).await;
    let big_header = "h".repeat(200 * 1024);
    db.exec(format!(
        "UPDATE {} SET headers = jsonb_build_object('a', '{big_header}', 'b', 'c') WHERE id = {id}",
        db.outbox.table()
    ))
    .await;
    let bytes: Vec<u8> = (0..1024 * 1024).map(|i| (i % 251) as u8 | 0x80).collect();
    db.exec(format!(
        "INSERT INTO {} (original_id, queue, payload, headers, attempts_count, deliveries_count, \
         created_at, failure_reason, last_error) VALUES (1, 'big', '\\x{}', \
         jsonb_build_object('k', '{big_header}'), 1, 1, now(), 'rejected', '{}')",
        db.outbox.dead_letter_table(),
        bytes.iter().map(|b| format!("{b:02x}")).collect::<String>(),
        "e".repeat(100_000),
    ))
    .await;
    let r = db.router(false, 50);

    let (status, page) = get(&r, &format!("/outbox/rows/{id}")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        page.len() < 200 * 1024,
        "the row page is {} bytes",
        page.len()
    );
    assert!(
        page.contains(&format!(
            "Showing the first {} of {} bytes of the JSON",
            crate::MAX_SHOWN_BYTES,
            json.len()
        )),
        "{}",
        &page[..2000]
    );
    // Not JSON: the cap counts the payload's bytes too, not the hex dump's.
    let raw = db.publish("big", &bytes[..200_000], None, 600).await;
    let (_, raw_page) = get(&r, &format!("/outbox/rows/{raw}")).await;
    assert!(
        raw_page.contains(&format!(
            "Not JSON: showing the first {} of 200000 bytes",
            crate::MAX_SHOWN_BYTES
        )),
        "{}",
        &raw_page[..2000]
    );
    assert!(page.contains("Showing 1 of 2 headers"), "headers cut");
    let (status, h, body) = download(&r, &format!("/outbox/rows/{id}/download/payload")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(h[header::CONTENT_TYPE], "application/octet-stream");
    assert_eq!(
        h[header::CONTENT_DISPOSITION],
        format!("attachment; filename=\"row-{id}-payload.bin\"").as_str()
    );
    assert_eq!(body, json.as_bytes(), "the raw payload, whole");
    let (_, _, body) = download(&r, &format!("/outbox/rows/{id}/download/headers")).await;
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["a"].as_str().map(str::len), Some(big_header.len()));
    let (status, _) = get(&r, &format!("/outbox/rows/{id}/download/nope")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    let (status, page) = get(&r, "/outbox/dead-letters").await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        page.len() < 64 * 1024,
        "the dead-letter page is {} bytes",
        page.len()
    );
    assert!(
        page.contains(&format!(
            "Not JSON: showing the first {} of {} bytes",
            crate::LIST_SHOWN_BYTES,
            bytes.len()
        )),
        "payload cut"
    );
    let dead: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT id FROM {}",
        db.outbox.dead_letter_table()
    )))
    .fetch_one(&db.pool)
    .await
    .unwrap();
    let (status, h, body) =
        download(&r, &format!("/outbox/dead-letters/{dead}/download/payload")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(h[header::CONTENT_TYPE], "application/octet-stream");
    assert_eq!(body, bytes);
    let (status, _) = get(
        &r,
        &format!("/outbox/dead-letters/{}/download/payload", dead + 1),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    db.drop_tables().await;
}

#[tokio::test]
async fn the_mount_answers_with_and_without_its_slash_and_bad_requests_get_the_page() {
    let db = Db::new().await;
    let r = Dashboard::new(db.outbox.clone(), db.pool.clone())
        .unwrap()
        .router_at("/outbox")
        .unwrap();
    let (status, body) = get(&r, "/outbox").await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("<h1>Queues</h1>"), "{body}");
    assert!(body.contains(r#"href="/outbox/assets/app.css""#), "{body}");
    let response = r
        .clone()
        .oneshot(
            Request::get("/outbox/")
                .header(header::HOST, HOST)
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::PERMANENT_REDIRECT);
    assert_eq!(response.headers()[header::LOCATION], "/outbox");
    let (status, _) = get(&r, "/outbox/queues/x").await;
    assert_eq!(status, StatusCode::OK);
    // axum's own refusals come back as the dashboard's page, saying what was wrong.
    for (path, status, says) in [
        (
            "/outbox/nowhere",
            StatusCode::NOT_FOUND,
            "no page at this address",
        ),
        (
            "/outbox/queues/%FF",
            StatusCode::BAD_REQUEST,
            "the address or form could not be read",
        ),
        (
            "/outbox/rows/1/pause",
            StatusCode::NOT_FOUND,
            "no page at this address",
        ),
        // axum decodes a query lossily: bytes that are not UTF-8 were a queue named with
        // U+FFFD (a fresh-user trial); a NUL reached the page.
        (
            "/outbox/queue?name=%F0%28%8C%28",
            StatusCode::BAD_REQUEST,
            "query holds a value that is not UTF-8",
        ),
        (
            "/outbox/queue?name=slow&q=%00",
            StatusCode::BAD_REQUEST,
            "query holds a NUL character",
        ),
        (
            "/outbox/dead-letters?redriven=maybe",
            StatusCode::BAD_REQUEST,
            "bad redriven",
        ),
        (
            "/outbox/rows/1/run-now",
            StatusCode::METHOD_NOT_ALLOWED,
            "an action is a POST",
        ),
    ] {
        let (got, body) = get(&r, path).await;
        assert_eq!(got, status, "{path}: {body}");
        assert!(
            body.contains("<h1>") && body.contains(says),
            "{path}: {body}"
        );
        assert!(body.contains("Back to the queues"), "{path}: {body}");
    }
    let response = r
        .clone()
        .oneshot(
            Request::post("/outbox/queue/pause?name=x")
                .header(header::HOST, HOST)
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from("{}"))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    assert!(
        String::from_utf8_lossy(&body).contains("not sent as a form"),
        "{body:?}"
    );
    for bad in ["outbox", "/outbox/", "/", "/{x}"] {
        let d = Dashboard::new(db.outbox.clone(), db.pool.clone()).unwrap();
        assert!(
            matches!(d.router_at(bad), Err(crate::UiError::InvalidSetting { .. })),
            "{bad:?}"
        );
    }
    db.drop_tables().await;
}

/// Timer ids are byte-exact: ` sp ` and `sp` are two rows, and cancelling one (through
/// its confirmation page) never touches the other; the search finds each as typed.
#[tokio::test]
async fn cancel_and_search_use_timer_ids_byte_exact_and_cancel_asks_first() {
    let db = Db::new().await;
    let spaced = db.publish("sp", b"{}", Some(" sp "), 600).await;
    let bare = db.publish("sp", b"{}", Some("sp"), 600).await;
    let r = db.router(false, 50);
    let (_, page) = get(&r, &format!("/outbox/rows/{spaced}")).await;
    assert!(page.contains(r#"name="timer_id" value=" sp ""#), "{page}");
    let t = token(&page);
    // The first POST only asks, and changes nothing.
    let (status, page) = post(
        &r,
        "/outbox/queue/cancel?name=sp",
        &format!("csrf={t}&timer_id=+sp+"),
        ORIGIN,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(page.contains("Yes, cancel the timer"), "{page}");
    assert!(page.contains(r#"name="timer_id" value=" sp ""#), "{page}");
    let live = |db: &Db| {
        let q = format!("SELECT id FROM {} ORDER BY id", db.outbox.table());
        let pool = db.pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(AssertSqlSafe(q))
                .fetch_all(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(live(&db).await, vec![spaced, bare]);
    let (_, location) = post(
        &r,
        "/outbox/queue/cancel?name=sp",
        &format!("csrf={t}&timer_id=+sp+&confirm=yes"),
        ORIGIN,
    )
    .await;
    assert_eq!(
        notice(&location),
        format!("timer \" sp \" of sp cancelled: row {spaced} deleted")
    );
    assert_eq!(live(&db).await, vec![bare], "the other row was cancelled");

    // Search: as typed first; ` sp ` finds nothing now, so its trimmed value `sp` does.
    let spaced = db.publish("sp", b"{}", Some(" sp "), 600).await;
    let r2 = r.clone();
    let go = |q: &'static str| {
        let r = r2.clone();
        async move {
            r.oneshot(
                Request::get(format!("/outbox/queue?name=sp&q={q}"))
                    .header(header::HOST, HOST)
                    .body(Body::empty())
                    .unwrap(),
            )
            .await
            .unwrap()
            .headers()
            .get(header::LOCATION)
            .map(|l| l.to_str().unwrap().to_owned())
        }
    };
    assert_eq!(go("%20sp%20").await, Some(format!("/outbox/rows/{spaced}")));
    assert_eq!(go("sp").await, Some(format!("/outbox/rows/{bare}")));
    db.exec(format!(
        "DELETE FROM {} WHERE id = {spaced}",
        db.outbox.table()
    ))
    .await;
    assert_eq!(go("%20sp%20").await, Some(format!("/outbox/rows/{bare}")));
    db.drop_tables().await;
}

/// Without the dead-letter table, `/dead-letters` is a normal page saying they are off (and
/// how to turn them on, in an application and from the command line), and the link says so.
#[tokio::test]
async fn dead_letters_off_is_a_page_not_an_error() {
    let db = Db::new().await;
    let off = Outbox::builder()
        .table(db.outbox.table().trim_matches('"'))
        .build()
        .unwrap();
    let d = Dashboard::new(off, db.pool.clone()).unwrap();
    let r = Router::new().nest("/outbox", d.router());
    let (status, page) = get(&r, "/outbox/dead-letters").await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert!(page.contains("Dead letters are off"), "{page}");
    assert!(page.contains("--dead-letter"), "{page}");
    let (_, page) = get(&r, "/outbox").await;
    assert!(page.contains("Dead letters (off)"), "{page}");
    let (_, page) = get(&db.router(false, 50), "/outbox").await;
    assert!(!page.contains("Dead letters (off)"), "{page}");
    db.drop_tables().await;
}

/// A counter just installed shows "–", not 0.00 averaged over minutes it did not count;
/// then it averages over the time since its install, and minutes before it are gaps.
#[tokio::test]
async fn a_new_throughput_counter_invents_no_history() {
    let db = Db::new().await;
    db.publish("fresh", b"{}", None, 3600).await;
    let r = db.router(false, 50);
    let dashboard = Dashboard::new(db.outbox.clone(), db.pool.clone()).unwrap();
    dashboard.install_throughput_counter().await.unwrap();
    let (_, page) = get(&r, "/outbox").await;
    assert_eq!(finished_per_second(&page, "fresh"), None, "{page}");
    assert!(
        page.contains("no rate until it has counted a full minute"),
        "{page}"
    );
    // A repeated install keeps the first install's instant.
    backdate_counter(&db, 120).await;
    dashboard.install_throughput_counter().await.unwrap();
    let c = crate::throughput::Names::of(&db.outbox).table;
    db.exec(format!(
        "INSERT INTO {c} VALUES ('fresh', 1, date_trunc('minute', now()), 120)"
    ))
    .await;
    let (_, page) = get(&r, "/outbox").await;
    let rate = finished_per_second(&page, "fresh").expect("a rate");
    // 120 rows over the ~120 s since install: about 1/s, not 120 over 4-5 minutes.
    assert!((0.9..=1.01).contains(&rate), "{rate}\n{page}");
    db_drop_counter(&c, &db.pool).await;
    db.drop_tables().await;
}

async fn db_drop_counter(c: &str, pool: &PgPool) {
    sqlx::query(AssertSqlSafe(format!("DROP TABLE IF EXISTS {c}")))
        .execute(pool)
        .await
        .unwrap();
}

/// The small things: a page of exactly `page_size` rows has no "Next page"; read-only
/// pages have no empty action columns; a 401 of basic_auth carries the security headers;
/// the live refresh drops the notice from the URL it fetches; long names wrap; notices
/// quote ids as they are (no Debug escaping of backslashes).
#[tokio::test]
async fn pages_without_dead_ends_or_empty_columns() {
    let db = Db::new().await;
    db.publish("two", b"{}", None, 600).await;
    db.publish("two", b"{}", None, 700).await;
    let r = db.router(false, 2);
    let (_, page) = get(&r, "/outbox/queue?name=two").await;
    assert!(page.contains("2 shown"), "{page}");
    assert!(
        !page.contains("Next page"),
        "a Next page leading to nothing: {page}"
    );
    db.publish("two", b"{}", None, 800).await;
    let (_, page) = get(&r, "/outbox/queue?name=two").await;
    assert!(
        page.contains("2 shown") && page.contains("Next page"),
        "{page}"
    );
    for i in 0..2 {
        db.exec(format!(
            "INSERT INTO {} (original_id, queue, payload, attempts_count, deliveries_count, \
             created_at, failure_reason, last_error) VALUES ({i}, 'two', '\\x00', 1, 1, now(), \
             'rejected', 'x')",
            db.outbox.dead_letter_table()
        ))
        .await;
    }
    let (_, page) = get(&r, "/outbox/dead-letters").await;
    assert!(!page.contains("Next page"), "{page}");

    let ro = db.router(true, 50);
    let (_, page) = get(&ro, "/outbox/queue?name=two").await;
    assert!(!page.contains(">Actions<"), "{page}");
    let (_, page) = get(&ro, "/outbox/dead-letters").await;
    assert!(
        !page.contains(">Redrive<") && page.contains(">Redriven<"),
        "{page}"
    );

    let locked = crate::basic_auth(db.router(false, 50), "ops", "pw");
    let denied = locked
        .oneshot(
            Request::get("/outbox")
                .header(header::HOST, HOST)
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(denied.status(), StatusCode::UNAUTHORIZED);
    for h in [
        header::CONTENT_SECURITY_POLICY,
        header::X_CONTENT_TYPE_OPTIONS,
        header::X_FRAME_OPTIONS,
        header::CACHE_CONTROL,
    ] {
        assert!(denied.headers().contains_key(&h), "{h} missing on a 401");
    }

    let (_, js) = get(&r, "/outbox/assets/app.js").await;
    assert!(
        js.contains(r#"["ok", "error", "sig"]"#) && js.contains("searchParams.delete"),
        "{js}"
    );
    let (_, css) = get(&r, "/outbox/assets/app.css").await;
    assert!(css.contains("overflow-wrap: anywhere"), "{css}");

    let (_, page) = get(&r, "/outbox/queue?name=two").await;
    let t = token(&page);
    let (_, location) = post(
        &r,
        "/outbox/queue/cancel?name=two",
        &format!("csrf={t}&timer_id=a%5Cb&confirm=yes"),
        ORIGIN,
    )
    .await;
    assert_eq!(
        notice(&location),
        r#"no live row of two holds the timer key "a\b""#
    );
    db.drop_tables().await;
}
