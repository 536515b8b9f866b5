//! Reads, statistics, operator actions, dead letters and schema checks through PgBouncer in
//! transaction mode (SPEC §13, §8), on a bare pooled connection and in a transaction.

use std::time::Duration;

use outbox::admin::RowAction;
use outbox::dlq::{DeadLetterFilter, Redrive, RedriveResult};
use outbox::message::Schedule;
use outbox::stats::StatsRequest;
use outbox::store::{ClaimRequest, Failure, FailureReason, Store};
use outbox::Message;
use sqlx::Connection;

use super::Through;

#[tokio::test]
async fn reads_stats_admin_and_dead_letters_work_through_pgbouncer() {
    let t = Through::new(6).await;
    let (o, q) = (&t.outbox, "pgb.reads");
    let mut conn = t.pooled.acquire().await.unwrap();
    let later = Schedule::from(Duration::from_secs(3600));
    let mut ids = Vec::new();
    for _ in 0..3 {
        let p = o
            .publish(&mut conn, Message::new(q, b"r").schedule(later))
            .await
            .unwrap();
        ids.push(p.id().unwrap());
    }

    // Reads and statistics, bare and in a transaction.
    assert_eq!(o.pending(&mut conn, q, 10).await.unwrap().len(), 3);
    let mut tx = conn.begin().await.unwrap();
    assert_eq!(o.pending(&mut tx, q, 10).await.unwrap().len(), 3);
    let stats = o
        .stats(&mut tx, &StatsRequest::new(Duration::from_secs(60)))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let row = stats
        .iter()
        .find(|s| s.queue == q)
        .expect("the queue's stats");
    assert_eq!(row.pending.value(), Some(3), "{row:?}");
    assert_eq!(t.store.pending(q, 10).await.unwrap().len(), 3);
    assert!(!t
        .store
        .stats(&StatsRequest::new(Duration::from_secs(60)))
        .await
        .unwrap()
        .is_empty());

    // Operator actions.
    assert!(o.pause_queue(&mut conn, q).await.unwrap());
    assert_eq!(o.paused_queues(&mut conn).await.unwrap().len(), 1);
    assert!(o.resume_queue(&mut conn, q).await.unwrap());
    assert!(matches!(
        o.run_now(&mut conn, ids[0]).await.unwrap(),
        RowAction::Rescheduled { .. }
    ));
    assert!(matches!(
        o.reschedule(&mut conn, ids[1], Duration::from_secs(7200))
            .await
            .unwrap(),
        RowAction::Rescheduled { .. }
    ));
    assert_eq!(
        o.delete_pending(&mut conn, ids[2]).await.unwrap(),
        RowAction::Deleted
    );

    // A dead letter: claimed, failed terminally, listed, redriven, purged.
    let queues = [q.to_owned()];
    let claimed = t
        .store
        .claim(ClaimRequest::new(&queues, 10, Duration::from_secs(60)))
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1, "the row made due now");
    let failure = Failure {
        reason: FailureReason::Rejected,
        last_error: Some("no"),
    };
    t.store.fail(claimed[0].lease, failure).await.unwrap();
    let filter = DeadLetterFilter::new().queue(q);
    let letters = o.dead_letters(&mut conn, &filter, None, 10).await.unwrap();
    assert_eq!(letters.len(), 1);
    let redriven = o
        .redrive_dead_letters(&mut conn, &Redrive::ids([letters[0].id]))
        .await
        .unwrap();
    assert!(
        matches!(redriven[0].result, RedriveResult::Redriven { .. }),
        "{redriven:?}"
    );
    let purged = o
        .purge_dead_letters(&t.pooled, &filter.clone().older_than(Duration::ZERO), 100)
        .await
        .unwrap();
    assert_eq!(purged, 1);

    // Schema checks read the catalog through the pooler too.
    o.validate_schema(&t.pooled).await.unwrap();
    assert!(!o.applied_migrations(&t.pooled).await.unwrap().is_empty());
    drop(conn);
    t.cleanup().await;
}
