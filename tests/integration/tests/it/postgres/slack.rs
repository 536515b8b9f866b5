//! Postgres-only checks of what keeps a busy table small: an extend skipped by its slack adds no row
//! version (what the slack is for), the `extend_<snake>_with_slack` function `#[timer]`
//! generates, and the autovacuum check a worker runs at start.

use std::time::Duration;

use outbox::{
    message::{OnConflict, MAX_SLACK},
    store::Store,
    Error, Message, Published,
};
use outbox_tests::Fixture;
use sqlx::AssertSqlSafe;

#[outbox::timer(queue = "slack.typed", max_deliveries = 3)]
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct SessionExpiry {
    user_id: i64,
}

/// `(ctid, xmin)` of the timer row: both change with every new row version.
async fn version(f: &Fixture, key: &str) -> (String, String) {
    let sql = format!(
        "SELECT ctid::text, xmin::text FROM {} WHERE timer_id = $1",
        f.outbox.table()
    );
    sqlx::query_as(AssertSqlSafe(&*sql))
        .bind(key)
        .fetch_one(&f.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn an_extend_within_the_slack_adds_no_row_version() {
    let f = Fixture::new().await;
    let mut conn = f.pool.acquire().await.unwrap();
    let ext = |after: u64| {
        Message::new("q", b"p")
            .timer_id("k")
            .schedule(Duration::from_secs(after))
            .on_conflict(OnConflict::Extend)
            .slack(Duration::from_secs(30))
    };
    assert!(matches!(
        f.outbox.publish(&mut conn, ext(60)).await.unwrap(),
        Published::Inserted { .. }
    ));
    let first = version(&f, "k").await;
    // 60 s → about 70 s after now: a move of less than 30 s.
    assert_eq!(
        f.outbox.publish(&mut conn, ext(70)).await.unwrap(),
        Published::Unchanged
    );
    assert_eq!(version(&f, "k").await, first, "no new row version");
    // About 60 s later: written, a new row version.
    assert!(matches!(
        f.outbox.publish(&mut conn, ext(120)).await.unwrap(),
        Published::Extended { .. }
    ));
    assert_ne!(version(&f, "k").await, first);
    drop(conn);
    f.cleanup().await;
}

#[tokio::test]
async fn the_generated_extend_with_slack() {
    let f = Fixture::new().await;
    let mut conn = f.pool.acquire().await.unwrap();
    let p = SessionExpiry { user_id: 7 };
    let slack = Duration::from_secs(30);
    let at = |s| Duration::from_secs(s);
    let first = extend_session_expiry_with_slack(f.outbox.on(&mut conn), "7", &p, at(60), slack)
        .await
        .unwrap();
    assert!(matches!(first, Published::Inserted { .. }), "{first:?}");
    let deadline = f.only_row("slack.typed").await.next_attempt_at;
    assert_eq!(
        extend_session_expiry_with_slack(f.outbox.on(&mut conn), "7", &p, at(80), slack)
            .await
            .unwrap(),
        Published::Unchanged
    );
    assert_eq!(f.only_row("slack.typed").await.next_attempt_at, deadline);
    assert_eq!(
        extend_session_expiry_with_slack(f.outbox.on(&mut conn), "7", &p, at(100), slack)
            .await
            .unwrap(),
        Published::Extended {
            id: first.id().unwrap()
        }
    );
    assert!(f.only_row("slack.typed").await.next_attempt_at > deadline);
    let e = extend_session_expiry_with_slack(
        f.outbox.on(&mut conn),
        "7",
        &p,
        at(200),
        MAX_SLACK + Duration::from_micros(1),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { field: "slack", .. }),
        "{e:?}"
    );
    drop(conn);
    f.cleanup().await;
}

#[tokio::test]
async fn the_autovacuum_check_reports_the_server_setting_and_the_table_option() {
    let f = Fixture::new().await;
    let server_off: bool = sqlx::query_scalar("SELECT current_setting('autovacuum') = 'off'")
        .fetch_one(&f.pool)
        .await
        .unwrap();
    let set = |on: &str| {
        format!(
            "ALTER TABLE {} SET (autovacuum_enabled = {on})",
            f.outbox.table()
        )
    };

    let off = f.store.autovacuum_off().await.unwrap();
    assert_eq!(off.is_some(), server_off, "{off:?}");
    if let Some(off) = off {
        assert!(off.server && !off.table_option, "{off:?}");
    }

    sqlx::query(AssertSqlSafe(set("off")))
        .execute(&f.pool)
        .await
        .unwrap();
    let off = f
        .store
        .autovacuum_off()
        .await
        .unwrap()
        .expect("reported off");
    assert!(off.table_option, "{off:?}");
    assert_eq!(off.server, server_off);
    assert_eq!(off.table, f.outbox.table());

    sqlx::query(AssertSqlSafe(set("true")))
        .execute(&f.pool)
        .await
        .unwrap();
    let off = f.store.autovacuum_off().await.unwrap();
    assert_eq!(off.map(|o| o.table_option), server_off.then_some(false));
    f.cleanup().await;
}
