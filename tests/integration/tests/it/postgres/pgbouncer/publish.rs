//! The publishing API through PgBouncer in transaction mode, in the application's
//! transactions and on bare connections (SPEC §13, §2, §3).

use std::time::Duration;

use futures::future::join_all;
use outbox::message::BatchItem;
use outbox::message::Schedule;
use outbox::{Cancelled, Message, Published};
use sqlx::Connection;

use super::Through;

/// Several clients, each in ten application transactions over the pooler's two server
/// connections: publish, publish a keyed timer, extend it, a batch, a timer cancelled in
/// the same transaction; a rolled-back transaction leaves nothing. Every call succeeds and
/// the rows are exactly those of the committed transactions.
#[tokio::test]
async fn publish_extend_cancel_and_batch_in_application_transactions() {
    let t = Through::new(6).await;
    let q = "pgb.publish";
    let clients = (0..4).map(|c| {
        let t = &t;
        async move {
            let mut conn = t.pooled.acquire().await.unwrap();
            for r in 0..10 {
                let mut tx = conn.begin().await.unwrap();
                let o = &t.outbox;
                let plain = o.publish(&mut tx, Message::new(q, b"plain")).await.unwrap();
                assert!(matches!(plain, Published::Inserted { .. }), "{plain:?}");
                let key = format!("k{c}-{r}");
                let in_1h = Message::new(q, b"v1")
                    .timer_id(&key)
                    .schedule(Duration::from_secs(3600));
                let first = o.publish(&mut tx, in_1h).await.unwrap();
                assert!(matches!(first, Published::Inserted { .. }), "{first:?}");
                let later = Message::new(q, b"v2")
                    .timer_id(&key)
                    .on_conflict(outbox::message::OnConflict::Extend)
                    .schedule(Duration::from_secs(7200));
                let extended = o.publish(&mut tx, later).await.unwrap();
                assert_eq!(
                    extended,
                    Published::Extended {
                        id: first.id().unwrap()
                    }
                );
                let items = [
                    BatchItem::new(b"b1"),
                    BatchItem::new(b"b2"),
                    BatchItem::new(b"b3"),
                ];
                let ids = o
                    .publish_batch(&mut tx, q, &items, Schedule::now())
                    .await
                    .unwrap();
                assert_eq!(ids.len(), 3);
                let gone = format!("x{c}-{r}");
                o.publish(&mut tx, Message::new(q, b"x").timer_id(&gone))
                    .await
                    .unwrap();
                let cancelled = o.cancel(&mut tx, q, &gone).await.unwrap();
                assert!(
                    matches!(cancelled, Cancelled::Deleted { .. }),
                    "{cancelled:?}"
                );
                tx.commit().await.unwrap();

                let mut tx = conn.begin().await.unwrap();
                o.publish(&mut tx, Message::new(q, b"rolled back"))
                    .await
                    .unwrap();
                tx.rollback().await.unwrap();
            }
        }
    });
    join_all(clients).await;

    let rows = t.rows(q).await;
    assert_eq!(
        rows.len(),
        4 * 10 * (1 + 1 + 3),
        "the committed rows, no more"
    );
    assert!(rows
        .iter()
        .all(|r| r.payload != b"rolled back" && r.payload != b"x"));
    let timers: Vec<_> = rows.iter().filter(|r| r.timer_id.is_some()).collect();
    assert_eq!(timers.len(), 40);
    assert!(
        timers.iter().all(|r| r.payload == b"v2"),
        "every extend landed"
    );
    t.cleanup().await;
}

/// On a pooled connection that is in no transaction (and through `&store`), each call runs
/// in a short transaction of its own: publish, extend, cancel and batch succeed, however
/// the pooler hands the connections around.
#[tokio::test]
async fn publish_extend_cancel_and_batch_on_bare_connections() {
    let t = Through::new(6).await;
    let q = "pgb.bare";
    let clients = (0..4).map(|c| {
        let t = &t;
        async move {
            let mut conn = t.pooled.acquire().await.unwrap();
            for r in 0..10 {
                let o = &t.outbox;
                let key = format!("k{c}-{r}");
                let first = o
                    .publish(
                        &mut conn,
                        Message::new(q, b"v1")
                            .timer_id(&key)
                            .schedule(Duration::from_secs(60)),
                    )
                    .await
                    .unwrap();
                assert!(matches!(first, Published::Inserted { .. }), "{first:?}");
                let extended = o
                    .publish(
                        &mut conn,
                        Message::new(q, b"v2")
                            .timer_id(&key)
                            .on_conflict(outbox::message::OnConflict::Extend)
                            .schedule(Duration::from_secs(120)),
                    )
                    .await
                    .unwrap();
                assert!(
                    matches!(extended, Published::Extended { .. }),
                    "{extended:?}"
                );
                let items = [BatchItem::new(b"b1"), BatchItem::new(b"b2")];
                o.publish_batch(&mut conn, q, &items, Schedule::now())
                    .await
                    .unwrap();
                let cancelled = o.cancel(&mut conn, q, &key).await.unwrap();
                assert!(
                    matches!(cancelled, Cancelled::Deleted { .. }),
                    "{cancelled:?}"
                );
                let via_store =
                    outbox::Publisher::publish_message(&t.store, Message::new(q, b"store"))
                        .await
                        .unwrap();
                assert!(matches!(via_store, Published::Inserted { .. }));
            }
        }
    });
    join_all(clients).await;
    assert_eq!(t.rows(q).await.len(), 4 * 10 * (2 + 1));
    t.cleanup().await;
}

/// Without the knob (sqlx's named, cached statements), the same transactions through the
/// pooler fail: the reason `transaction_pooler` exists.
#[tokio::test]
async fn without_the_knob_publishing_through_pgbouncer_fails() {
    let t = Through::new(6).await;
    let q = "pgb.named";
    let clients = (0..4).map(|_| {
        let t = &t;
        async move {
            let mut conn = t.pooled.acquire().await.unwrap();
            let mut errors = Vec::new();
            for _ in 0..20 {
                let result = async {
                    let mut tx = conn.begin().await?;
                    t.plain.publish(&mut tx, Message::new(q, b"p")).await?;
                    t.plain
                        .publish_batch(&mut tx, q, &[BatchItem::new(b"b")], Schedule::now())
                        .await?;
                    tx.commit().await?;
                    Ok::<_, outbox::Error>(())
                }
                .await;
                if let Err(e) = result {
                    errors.push(e.to_string());
                }
            }
            errors
        }
    });
    let errors: Vec<String> = join_all(clients).await.into_iter().flatten().collect();
    assert!(
        errors.iter().any(|e| e.contains("prepared statement")),
        "named statements through PgBouncer 1.18: {errors:?}"
    );
    t.cleanup().await;
}
