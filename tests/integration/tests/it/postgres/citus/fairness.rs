//! Fairness across queues and shards on a Citus cluster (SPEC §6 and its v3 addendum, §13;
//! issue 28 req 4): a claim over several buckets takes what a single node's claim takes,
//! round robin across the queues, however the queues' rows spread over the buckets.

use super::*;

/// Publishes `n` plain messages to `queue`; without a shard key they go round robin over
/// the buckets.
async fn spread(f: &Fixture, queue: &str, n: usize) -> Vec<i64> {
    let mut conn = f.pool.acquire().await.unwrap();
    let mut ids = Vec::new();
    for i in 0..n {
        match f
            .outbox
            .publish(&mut conn, Message::new(queue, format!("{i}").as_bytes()))
            .await
            .unwrap()
        {
            Published::Inserted { id } => ids.push(id),
            other => panic!("{other:?}"),
        }
    }
    ids
}

fn bucket(id: i64) -> i64 {
    id.rem_euclid(i64::from(CITUS_BUCKETS))
}

#[tokio::test]
#[ignore = "needs a Citus cluster: .ci/citus -- cargo nextest run --run-ignored only -E 'test(/citus/)'"]
async fn a_claim_takes_a_small_queues_row_beside_a_backlog_spread_over_every_bucket() {
    let f = cluster().await;
    // 20 rows of `big` in each of the 16 buckets, all due before `small`'s one row.
    let big = spread(&f, "big", 20 * usize::from(CITUS_BUCKETS)).await;
    let buckets: HashSet<i64> = big.iter().map(|id| bucket(*id)).collect();
    assert_eq!(
        buckets.len(),
        usize::from(CITUS_BUCKETS),
        "spread over every bucket"
    );
    let small = spread(&f, "small", 1).await[0];

    let qs = vec!["big".to_owned(), "small".to_owned()];
    let claimed = f.store.claim(ClaimRequest::new(&qs, 8, TTL)).await.unwrap();
    let ids: Vec<i64> = claimed.iter().map(|d| d.lease.id).collect();
    assert_eq!(claimed.len(), 8, "{ids:?}");
    assert!(
        ids.contains(&small),
        "a claim of 8 over 2 queues takes small's row {small}, as a single node's does: {ids:?}"
    );
    // The rest are big's earliest: the first 7 it published... in its earliest bucket, as
    // the plan gives a queue's share to the bucket whose row came due first.
    let first = bucket(big[0]);
    assert!(
        claimed
            .iter()
            .filter(|d| d.queue == "big")
            .all(|d| bucket(d.lease.id) == first),
        "{ids:?}"
    );
    // Round robin in the claimed batch, as on a single node: big, small, then big.
    assert_eq!(claimed[0].queue, "big");
    assert_eq!(claimed[1].queue, "small");
    f.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a Citus cluster: .ci/citus -- cargo nextest run --run-ignored only -E 'test(/citus/)'"]
async fn consecutive_claims_serve_every_queue_within_as_many_claims_as_queues() {
    let f = cluster().await;
    spread(&f, "a-big", 64).await;
    spread(&f, "b-mid", 32).await;
    let small = spread(&f, "c-small", 1).await[0];
    let qs = vec!["a-big".to_owned(), "b-mid".to_owned(), "c-small".to_owned()];

    // Claims of one row, each resuming after the queue the previous one served (what the
    // worker's claim loop does): with 3 queues holding due rows, each is served within 3
    // claims whatever the others' backlogs and buckets.
    let mut served = Vec::new();
    let mut last: Option<String> = None;
    for _ in 0..6 {
        let mut request = ClaimRequest::new(&qs, 1, TTL);
        if let Some(q) = last.as_deref() {
            request = request.resume_after(q);
        }
        let claimed = f.store.claim(request).await.unwrap();
        assert_eq!(claimed.len(), 1);
        if claimed[0].queue == "c-small" {
            assert_eq!(claimed[0].lease.id, small);
        }
        served.push(claimed[0].queue.clone());
        last = Some(claimed[0].queue.clone());
    }
    assert_eq!(
        served,
        ["a-big", "b-mid", "c-small", "a-big", "b-mid", "a-big"],
        "round robin across claims, across the buckets"
    );
    f.cleanup().await;
}
