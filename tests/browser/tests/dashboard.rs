//! The dashboard in a real browser (SPEC §15): Debian's headless Chromium, driven through
//! chromedriver (WebDriver), against real Postgres. Loads every page, pauses and resumes a
//! queue, searches a timer, redrives a dead letter, shows a `<script>` payload as text,
//! and checks read-only mode; writes a screenshot of each page.
//!
//! Screenshots go to `<target>/tmp/screenshots/` (`CARGO_TARGET_TMPDIR`), so a run leaves
//! the checkout clean; with `OUTBOX_UPDATE_SCREENSHOTS=1` they replace the checked-in ones
//! in `docs/img/` (do that when the pages change, and commit them):
//! `OUTBOX_UPDATE_SCREENSHOTS=1 cargo nextest run -p outbox-ui-browser-tests --run-ignored all`.
//!
//! Ignored by the workspace's test command (a machine without Chromium can run the rest);
//! `.ci/run` installs `chromium` and `chromium-driver` and runs it with `--run-ignored all`.
//! It fails, never skips, when chromedriver or the browser cannot start.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use outbox::Message;
use outbox::Outbox;
use serde_json::{json, Value};
use sqlx::{AssertSqlSafe, PgPool};
use tokio::process::{Child, Command};

const XSS_JSON: &str = r#"{"html":"<script>window.__xss=1</script>","user":"<b>bold</b>"}"#;
const XSS_HEADER: &str = "<script>window.__xss=2</script>";
const XSS_BYTES: &[u8] = b"\xff\x00<script>window.__xss=3</script>";

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("no free local port")
}

/// chromedriver on a free port, killed on drop.
struct Driver {
    child: Child,
    url: String,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

async fn start_driver() -> Driver {
    let bin = std::env::var("CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".to_owned());
    let port = free_port();
    let child = Command::new(&bin)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "cannot start {bin:?} ({e}): install Debian's chromium and chromium-driver \
                 (apt-get install -y chromium chromium-driver), or set CHROMEDRIVER"
            )
        });
    let url = format!("http://127.0.0.1:{port}");
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return Driver { child, url };
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{bin} did not listen on port {port} within 10 s");
}

async fn browser(driver: &Driver, profile: &tempfile::TempDir) -> Client {
    let chrome = std::env::var("CHROME_BIN").unwrap_or_else(|_| "/usr/bin/chromium".to_owned());
    let args = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
    ]
    .iter()
    .map(|a| (*a).to_owned())
    .chain([format!("--user-data-dir={}", profile.path().display())])
    .collect::<Vec<_>>();
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".to_owned(),
        json!({ "binary": chrome, "args": args }),
    );
    ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&driver.url)
        .await
        .unwrap_or_else(|e| panic!("chromedriver could not start the browser {chrome:?}: {e}"))
}

/// The dashboard nested at `/outbox` of an app, on a free port.
async fn serve(outbox: Outbox, pool: PgPool, read_only: bool) -> SocketAddr {
    let dashboard = outbox_ui::Dashboard::new(outbox, pool)
        .expect("dashboard")
        .read_only(read_only);
    let app = axum::Router::new()
        .route("/", axum::routing::get(|| async { "the application" }))
        .nest("/outbox", dashboard.router());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// `docs/img/` with `OUTBOX_UPDATE_SCREENSHOTS=1`, else a directory of the target dir.
fn screenshots() -> PathBuf {
    if std::env::var("OUTBOX_UPDATE_SCREENSHOTS").is_ok_and(|v| v == "1") {
        return PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/img");
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("screenshots");
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
    dir
}

async fn shot(c: &Client, name: &str) {
    let png = c.screenshot().await.expect("screenshot");
    let path = screenshots().join(format!("dashboard-{name}.png"));
    std::fs::write(&path, png).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

async fn text_of(c: &Client, css: &str) -> String {
    // The queues page replaces its <main> every 5 s, and a click may still be loading the
    // next page: an element found just before either is stale, so find it again.
    let mut last = String::new();
    for _ in 0..5 {
        let url = c
            .current_url()
            .await
            .map(|u| u.to_string())
            .unwrap_or_default();
        let element = c
            .wait()
            .at_most(Duration::from_secs(10))
            .for_element(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("no element {css} on {url}: {e}"));
        match element.text().await {
            Ok(text) => return text,
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("the text of {css}: {last}")
}

/// Clicks the link whose text is `text` (again after a refresh of the queues page).
async fn click_link(c: &Client, text: &str) {
    let mut last = String::new();
    for _ in 0..3 {
        match c.find(Locator::LinkText(text)).await {
            Ok(link) => match link.click().await {
                Ok(()) => return,
                Err(e) => last = e.to_string(),
            },
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("cannot click the link {text:?}: {last}");
}

async fn click_button(c: &Client, label: &str) {
    // The queues page replaces its <main> every 5 s: a button found just before a refresh is
    // stale by the click, so find it again (a few times) rather than fail on the race.
    let xpath = format!("//button[normalize-space(.)='{label}']");
    let mut last = String::new();
    for _ in 0..3 {
        match c.find(Locator::XPath(&xpath)).await {
            Ok(button) => match button.click().await {
                Ok(()) => return,
                Err(e) => last = e.to_string(),
            },
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("cannot click the button {label:?}: {last}");
}

struct Data {
    outbox: Outbox,
    pool: PgPool,
    keyed_id: i64,
    xss_id: i64,
    bytes_id: i64,
    leased_id: i64,
    dead_letter_id: i64,
}

async fn setup() -> Data {
    let pool = PgPool::connect(&database_url()).await.unwrap_or_else(|e| {
        panic!(
            "cannot reach Postgres at {} ({e}): start it, or set DATABASE_URL",
            database_url()
        )
    });
    let table = format!(
        "ui_browser_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    );
    let outbox = Outbox::builder()
        .table(&table)
        .dead_letter(true)
        .build()
        .unwrap();
    outbox.migrate(&pool).await.expect("migrate");
    let mut conn = pool.acquire().await.unwrap();
    let publish = |queue: &'static str, payload: &'static [u8]| Message::new(queue, payload);
    for i in 0..5 {
        let payload: &'static [u8] =
            Box::leak(format!(r#"{{"mail":{i}}}"#).into_bytes().into_boxed_slice());
        outbox
            .publish(
                &mut conn,
                publish("ui.mail", payload).schedule(Duration::from_secs(30 * i)),
            )
            .await
            .unwrap();
    }
    let keyed = outbox
        .publish(
            &mut conn,
            publish("ui.timers", br#"{"user":42}"#)
                .timer_id("presence:42")
                .schedule(Duration::from_secs(90)),
        )
        .await
        .unwrap();
    let headers = [("x-note".to_owned(), XSS_HEADER.to_owned())].into();
    let headers: &'static _ = Box::leak(Box::new(headers));
    let xss = outbox
        .publish(
            &mut conn,
            publish("ui.timers", XSS_JSON.as_bytes())
                .timer_id("xss")
                .headers(headers)
                .schedule(Duration::from_secs(600)),
        )
        .await
        .unwrap();
    let bytes = outbox
        .publish(&mut conn, publish("ui.timers", XSS_BYTES))
        .await
        .unwrap();
    // A queue named `..`: its link must survive the browser's path normalisation.
    outbox
        .publish(
            &mut conn,
            publish("..", b"{}").schedule(Duration::from_secs(3600)),
        )
        .await
        .unwrap();
    let leased = outbox
        .publish(&mut conn, publish("ui.mail", br#"{"mail":"running"}"#))
        .await
        .unwrap();
    let id = |p: outbox::Published| p.id().expect("a new row");
    let leased_id = id(leased);
    // A worker's claim, as the claim statement writes it.
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {} SET acquired_token = gen_random_uuid(), acquired_at = now(), \
         deliveries_count = 1 WHERE id = $1",
        outbox.table()
    )))
    .bind(leased_id)
    .execute(&mut *conn)
    .await
    .unwrap();
    let dead_letter_id: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "INSERT INTO {} (original_id, queue, payload, headers, attempts_count, \
         deliveries_count, created_at, failure_reason, last_error) VALUES \
         (9999, 'ui.mail', '\\x7b7d', '{{}}', 3, 3, now() - interval '1 hour', \
          'retry_exhausted', 'smtp: 550 <script>window.__xss=4</script>') RETURNING id",
        outbox.dead_letter_table()
    )))
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    // A periodic schedule's row, as a worker's registration writes it.
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {} (queue, payload, headers, timer_id, next_attempt_at, last_attempt_at) \
         VALUES ('ui.reports', '\\x7b7d', '{{\"outbox-schedule\": \"every:3600s\"}}', \
         'schedule:hourly-report', now() + interval '20 minutes', now() - interval '40 minutes')",
        outbox.table()
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    drop(conn);
    Data {
        keyed_id: id(keyed),
        xss_id: id(xss),
        bytes_id: id(bytes),
        leased_id,
        dead_letter_id,
        outbox,
        pool,
    }
}

async fn xss_ran(c: &Client) -> Value {
    c.execute("return typeof window.__xss;", vec![])
        .await
        .expect("execute")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Chromium and chromedriver: .ci/run runs it (--run-ignored all)"]
async fn the_dashboard_in_a_real_browser() {
    let d = setup().await;
    let driver = start_driver().await;
    let profile = tempfile::tempdir().unwrap();
    let c = browser(&driver, &profile).await;
    // The per-queue throughput counter, so the queues page (and its screenshot) has it.
    let counter = outbox_ui::Dashboard::new(d.outbox.clone(), d.pool.clone()).expect("dashboard");
    counter
        .install_throughput_counter()
        .await
        .expect("install the throughput counter");
    let result = run(&c, &d).await;
    let _ = c.close().await;
    let _ = counter.remove_throughput_counter().await;
    let t = d.outbox.table().to_owned();
    let dl = d.outbox.dead_letter_table().to_owned();
    for table in [t, dl] {
        let _ = sqlx::query(AssertSqlSafe(format!(
            "DROP TABLE IF EXISTS {table} CASCADE"
        )))
        .execute(&d.pool)
        .await;
    }
    let _ = sqlx::query(AssertSqlSafe(format!(
        "DROP TABLE IF EXISTS {}, {} CASCADE",
        d.outbox.paused_table(),
        d.outbox.migrations_table()
    )))
    .execute(&d.pool)
    .await;
    result.unwrap_or_else(|e| panic!("{e}"));
}

async fn run(c: &Client, d: &Data) -> Result<(), String> {
    let addr = serve(d.outbox.clone(), d.pool.clone(), false).await;
    let base = format!("http://{addr}/outbox");

    // The queues page: every queue, its figures, a sparkline; the refresh script loads.
    c.goto(&base.clone()).await.map_err(|e| e.to_string())?;
    let table = text_of(c, "main table").await;
    if !table.contains("Finished/s") {
        return Err(format!("no throughput column: {table}"));
    }
    for q in ["ui.mail", "ui.timers"] {
        if !table.contains(q) {
            return Err(format!("the queues page does not list {q}: {table}"));
        }
    }
    if c.find_all(Locator::Css("svg.spark"))
        .await
        .map_err(|e| e.to_string())?
        .len()
        < 2
    {
        return Err("no sparkline per queue".into());
    }

    // Live refresh: the script replaces <main> with a fresh read within one period (5 s).
    let mut refreshed = json!(null);
    for _ in 0..40 {
        refreshed = c
            .execute(
                "return document.getElementById('main').dataset.refreshed || null;",
                vec![],
            )
            .await
            .map_err(|e| e.to_string())?;
        if refreshed.is_string() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    if !refreshed.is_string() {
        return Err("the queues page did not refresh itself within 10 s".into());
    }
    // After a refresh: two samples, so the sparklines and the throughput have data.
    shot(c, "queues").await;

    // Pause and resume a queue: the notice, and the library sees it.
    click_button(c, "Pause ui.mail").await;
    let notice = text_of(c, ".notice.ok").await;
    if notice != "ui.mail: paused" {
        return Err(format!("pause notice: {notice:?}"));
    }
    let mut conn = d.pool.acquire().await.map_err(|e| e.to_string())?;
    let paused = d
        .outbox
        .paused_queues(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    if !paused.iter().any(|p| p.queue == "ui.mail") {
        return Err("the queue is not paused in the database".into());
    }
    click_button(c, "Resume ui.mail").await;
    let notice = text_of(c, ".notice.ok").await;
    if notice != "ui.mail: running" {
        return Err(format!("resume notice: {notice:?}"));
    }
    if !d
        .outbox
        .paused_queues(&mut conn)
        .await
        .map_err(|e| e.to_string())?
        .is_empty()
    {
        return Err("the queue is still paused".into());
    }

    // A notice in a link is not the dashboard's: not shown.
    c.goto(&format!("{base}?ok=Queue%20purged%2C%20now%20run%20X"))
        .await
        .map_err(|e| e.to_string())?;
    text_of(c, "h1").await;
    if !c
        .find_all(Locator::Css(".notice"))
        .await
        .map_err(|e| e.to_string())?
        .is_empty()
    {
        return Err("a notice from a link's query is shown".into());
    }

    // The queue named `..`: its link leads to its page, not to the application's root.
    click_link(c, "..").await;
    for _ in 0..50 {
        let url = c.current_url().await.map_err(|e| e.to_string())?;
        if url.path().ends_with("/queue") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let title = text_of(c, "h1").await;
    if title != "Queue .." {
        return Err(format!("the link of the queue `..` leads to {title:?}"));
    }

    // A queue page: rows by deadline; the leased row has no action.
    c.goto(&format!("{base}/queue?name=ui.mail"))
        .await
        .map_err(|e| e.to_string())?;
    let rows = text_of(c, "main table tbody").await;
    if !rows.contains("held by a worker") || !rows.contains(&d.leased_id.to_string()) {
        return Err(format!("the leased row is not shown as held: {rows}"));
    }
    shot(c, "queue").await;

    // Search a timer by its id: the row's page.
    c.goto(&format!("{base}/queue?name=ui.timers"))
        .await
        .map_err(|e| e.to_string())?;
    let search = c
        .find(Locator::Css("input[name=q]"))
        .await
        .map_err(|e| e.to_string())?;
    search
        .send_keys("presence:42")
        .await
        .map_err(|e| e.to_string())?;
    click_button(c, "Show").await;
    let title = text_of(c, "h1").await;
    if title != format!("Row {}", d.keyed_id) {
        return Err(format!("the search for presence:42 led to {title:?}"));
    }
    let url = c.current_url().await.map_err(|e| e.to_string())?;
    if !url
        .path()
        .ends_with(&format!("/outbox/rows/{}", d.keyed_id))
    {
        return Err(format!("search landed on {url}"));
    }

    // The <script> payload and header render as text; no script of theirs ran.
    c.goto(&format!("{base}/rows/{}", d.xss_id))
        .await
        .map_err(|e| e.to_string())?;
    let payload = text_of(c, "pre.payload").await;
    if !payload.contains("<script>window.__xss=1</script>") {
        return Err(format!("the JSON payload is not shown as text: {payload}"));
    }
    let headers = text_of(c, "table.headers").await;
    if !headers.contains(XSS_HEADER) {
        return Err(format!("the header is not shown as text: {headers}"));
    }
    if xss_ran(c).await != json!("undefined") {
        return Err("a script from the payload or headers ran".into());
    }
    shot(c, "row").await;
    c.goto(&format!("{base}/rows/{}", d.bytes_id))
        .await
        .map_err(|e| e.to_string())?;
    let dump = text_of(c, "pre.payload").await;
    if !dump.starts_with("00000000  ff 00 3c 73") || !dump.contains("..<script>window") {
        return Err(format!("the raw payload is not a hex dump: {dump}"));
    }
    if xss_ran(c).await != json!("undefined") {
        return Err("a script from the raw payload ran".into());
    }

    // Dead letters: the error is text; redrive.
    c.goto(&format!("{base}/dead-letters"))
        .await
        .map_err(|e| e.to_string())?;
    let list = text_of(c, "main table").await;
    if !list.contains("smtp: 550 <script>window.__xss=4</script>")
        || !list.contains("retry_exhausted")
    {
        return Err(format!(
            "the dead letter is not listed with its error: {list}"
        ));
    }
    if xss_ran(c).await != json!("undefined") {
        return Err("a script from a dead letter's error ran".into());
    }
    shot(c, "dead-letters").await;
    click_button(c, "Redrive").await;
    // It asks first.
    click_button(c, "Yes, redrive").await;
    let notice = text_of(c, ".notice.ok").await;
    if !notice.contains(&format!(
        "dead letter {}: redriven as row",
        d.dead_letter_id
    )) {
        return Err(format!("redrive notice: {notice:?}"));
    }
    let redriven: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT redriven_id FROM {} WHERE id = $1",
        d.outbox.dead_letter_table()
    )))
    .bind(d.dead_letter_id)
    .fetch_one(&mut *conn)
    .await
    .map_err(|e| e.to_string())?;
    if redriven.is_none() {
        return Err("the dead letter is not marked redriven".into());
    }

    // The schedules page: the schedule, its recurrence, next instant and last run.
    c.goto(&format!("{base}/schedules"))
        .await
        .map_err(|e| e.to_string())?;
    let list = text_of(c, "main table").await;
    // Ages in two units: "40 min 8 s ago" (the seconds depend on how long the test took).
    if !list.contains("hourly-report") || !list.contains("every 1h") || !list.contains("(40 min ") {
        return Err(format!("schedules page: {list}"));
    }
    shot(c, "schedules").await;

    // The schema page.
    c.goto(&format!("{base}/schema"))
        .await
        .map_err(|e| e.to_string())?;
    let check = text_of(c, ".notice").await;
    if check != "The schema matches this version." {
        return Err(format!("schema check: {check:?}"));
    }
    shot(c, "schema").await;

    // Keyboard: the skip link is the first stop and leads to the content.
    c.goto(&base.clone()).await.map_err(|e| e.to_string())?;
    let first = c
        .execute(
            "document.body.focus(); var a = document.querySelector('a.skip'); a.focus(); \
             return document.activeElement.getAttribute('href');",
            vec![],
        )
        .await
        .map_err(|e| e.to_string())?;
    if first != json!("#main") {
        return Err(format!("the skip link is not focusable: {first}"));
    }

    // A forged POST (no token) is refused and changes nothing.
    let status = c
        .execute(
            "return fetch(arguments[0], {method: 'POST', headers: {'Content-Type': \
             'application/x-www-form-urlencoded'}, body: 'csrf=forged'}).then(r => r.status);",
            vec![json!(format!("{base}/queue/pause?name=ui.mail"))],
        )
        .await
        .map_err(|e| e.to_string())?;
    if status != json!(403) {
        return Err(format!("a POST without the token was answered {status}"));
    }
    if !d
        .outbox
        .paused_queues(&mut conn)
        .await
        .map_err(|e| e.to_string())?
        .is_empty()
    {
        return Err("a forged POST paused the queue".into());
    }

    // Read-only: no form that posts, and a POST with the page's own token is refused.
    let ro = serve(d.outbox.clone(), d.pool.clone(), true).await;
    let ro_base = format!("http://{ro}/outbox");
    for page in [
        "",
        "/queue?name=ui.mail",
        &format!("/rows/{}", d.keyed_id),
        "/dead-letters",
    ] {
        c.goto(&format!("{ro_base}{page}"))
            .await
            .map_err(|e| e.to_string())?;
        text_of(c, "h1").await;
        let forms = c
            .find_all(Locator::Css("form[method=post]"))
            .await
            .map_err(|e| e.to_string())?;
        if !forms.is_empty() {
            return Err(format!(
                "read-only page {page} has {} action form(s)",
                forms.len()
            ));
        }
        if page.is_empty() {
            shot(c, "read-only").await;
        }
    }
    let status = c
        .execute(
            "return fetch(arguments[0], {method: 'POST', body: new URLSearchParams({csrf: 'x'})}).then(r => r.status);",
            vec![json!(format!("{ro_base}/queue/pause?name=ui.mail"))],
        )
        .await
        .map_err(|e| e.to_string())?;
    if status != json!(403) {
        return Err(format!(
            "a POST to the read-only dashboard was answered {status}"
        ));
    }
    Ok(())
}
