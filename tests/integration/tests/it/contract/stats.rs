//! Queue statistics (SPEC §8): exact counts of every state per queue on the frozen clock.

use super::*;

/// The figures of one queue as a tuple: `(queue, pending, due, leased, expired_leases,
/// oldest_due_lateness, rearms, cancel_marks, dead_letters)`.
type Figures = (
    String,
    Count,
    Count,
    Count,
    Count,
    Option<Duration>,
    Count,
    Count,
    Count,
);

fn figures(s: &QueueStats) -> Figures {
    (
        s.queue.clone(),
        s.pending,
        s.due,
        s.leased,
        s.expired_leases,
        s.oldest_due_lateness,
        s.rearms,
        s.cancel_marks,
        s.dead_letters,
    )
}

/// Exact figures, in the order of [`Figures`] (lateness in whole seconds).
#[allow(clippy::too_many_arguments)]
fn exact(
    queue: &str,
    pending: u64,
    due: u64,
    leased: u64,
    expired: u64,
    late_s: Option<u64>,
    rearms: u64,
    cancel_marks: u64,
    dead: Count,
) -> Figures {
    (
        queue.to_owned(),
        Count::Exact(pending),
        Count::Exact(due),
        Count::Exact(leased),
        Count::Exact(expired),
        late_s.map(secs),
        Count::Exact(rearms),
        Count::Exact(cancel_marks),
        dead,
    )
}

async fn stats<H: Harness>(h: &H, request: &StatsRequest) -> Result<Vec<Figures>, Error> {
    let got = h.store().queue_stats(request).await?;
    let got = got.unwrap_or_else(|| panic!("{}: the store has no statistics", H::NAME));
    Ok(got.iter().map(figures).collect())
}

/// Rows in every state on three queues, read at t = 45 s:
///
/// - `Q`: timer `k1` leased at 0 with a queued rearm, timer `k2` leased at 0 with a cancel
///   mark, a plain row leased at 0, a row due at 10 (late by 35 s), a row due at 1010, one
///   dead letter;
/// - `Q2`: a row leased at 30, a row due at 15 (late by 30 s);
/// - `Q3`: only a dead letter.
async fn crafted_states<H: Harness>(h: &H) {
    publish(h, Message::new(Q, b"k1").timer_id("k1")).await;
    publish(h, Message::new(Q, b"k2").timer_id("k2")).await;
    publish(h, Message::new(Q, b"plain")).await;
    publish(h, Message::new(Q, b"to-dlq")).await;
    publish(h, Message::new(Q3, b"to-dlq")).await;
    assert_eq!(claim(h, &[Q], 4).await.len(), 4);
    let q3 = claim(h, &[Q3], 1).await;
    let failed = claim(h, &[Q], 10).await;
    assert!(failed.is_empty(), "{}: {failed:#?}", H::NAME);
    // The two plain rows of Q were claimed last (ids 3 and 4): fail the fourth, and Q3's.
    let held = rows(h, Q).await;
    let fourth = held.iter().find(|r| r.payload == b"to-dlq").unwrap();
    let lease = Lease {
        id: fourth.id,
        token: fourth.acquired_token.unwrap(),
    };
    h.store().fail(lease, rejected(Some("no"))).await.unwrap();
    h.store()
        .fail(q3[0].lease, rejected(Some("no")))
        .await
        .unwrap();

    h.advance(secs(10)).await;
    assert!(matches!(
        publish(h, extend("k1", b"k1 again", secs(60))).await,
        Published::RearmQueued { .. }
    ));
    assert!(matches!(
        h.cancel(Q, "k2").await.unwrap(),
        Cancelled::Running { .. }
    ));
    publish(h, plain(b"due at 10", 0)).await;
    publish(h, plain(b"due at 1010", 1000)).await;
    publish(h, Message::new(Q2, b"due at 10")).await;
    publish(h, Message::new(Q2, b"due at 15").schedule(secs(5))).await;
    h.advance(secs(20)).await;
    assert_eq!(claim(h, &[Q2], 1).await.len(), 1);
    h.advance(secs(15)).await;
}

async fn stats_count_every_state_per_queue<H: Harness>(h: &H) {
    crafted_states(h).await;
    let dead = Count::Exact;
    // Default TTL 40 s: Q's leases (45 s old) expired, Q2's (15 s old) not.
    let ttl = StatsRequest::new(secs(40));
    assert_eq!(
        stats(h, &ttl).await.unwrap(),
        vec![
            exact(Q, 2, 1, 3, 3, Some(35), 1, 1, dead(1)),
            exact(Q2, 1, 1, 1, 0, Some(30), 0, 0, dead(0)),
            exact(Q3, 0, 0, 0, 0, None, 0, 0, dead(1)),
        ],
        "{}",
        H::NAME
    );
    // Per-queue TTLs: Q's workers hold leases for 50 s (none expired), Q2's for 10 s (its
    // lease, 15 s old, expired). Exactly at the TTL a lease is not expired yet (`<`).
    let per_queue = ttl
        .clone()
        .lease_ttl_for(Q, secs(50))
        .lease_ttl_for(Q2, secs(10));
    let got = stats(h, &per_queue).await.unwrap();
    assert_eq!(got[0], exact(Q, 2, 1, 3, 0, Some(35), 1, 1, dead(1)));
    assert_eq!(got[1], exact(Q2, 1, 1, 1, 1, Some(30), 0, 0, dead(0)));
    let edge = StatsRequest::new(secs(45)).lease_ttl_for(Q2, secs(15));
    let got = stats(h, &edge).await.unwrap();
    assert_eq!((got[0].4, got[1].4), (Count::Exact(0), Count::Exact(0)));
    // A queue list: those queues only, each once, a queue without rows with zeros.
    let listed = ttl.clone().queues(["q.none", Q2, Q3, Q2]);
    assert_eq!(
        stats(h, &listed).await.unwrap(),
        vec![
            exact("q.none", 0, 0, 0, 0, None, 0, 0, dead(0)),
            exact(Q2, 1, 1, 1, 0, Some(30), 0, 0, dead(0)),
            exact(Q3, 0, 0, 0, 0, None, 0, 0, dead(1)),
        ]
    );
    assert!(stats(h, &ttl.clone().queues(Vec::<String>::new()))
        .await
        .unwrap()
        .is_empty());
    // A claim (lease TTL 30 s) takes the due rows and Q's expired leases, deleting the
    // cancelled one instead of delivering it: nothing is due or expired any more, the row
    // due at 1010 stays pending, k1's rearm stays queued.
    assert_eq!(claim(h, &[Q, Q2], 10).await.len(), 4);
    let got = stats(h, &ttl.queues([Q])).await.unwrap();
    assert_eq!(got, vec![exact(Q, 1, 0, 3, 0, None, 1, 0, dead(1))]);
}

async fn stats_without_the_dead_letter_queue<H: Harness>(h: &H) {
    crafted_states(h).await;
    // Terminal failures deleted their rows: Q3 has nothing left, and dead letters are not
    // measured.
    let none = Count::Unavailable;
    assert_eq!(
        stats(h, &StatsRequest::new(secs(40))).await.unwrap(),
        vec![
            exact(Q, 2, 1, 3, 3, Some(35), 1, 1, none),
            exact(Q2, 1, 1, 1, 0, Some(30), 0, 0, none),
        ]
    );
    let listed = StatsRequest::new(secs(40)).queues([Q3]);
    assert_eq!(
        stats(h, &listed).await.unwrap(),
        vec![exact(Q3, 0, 0, 0, 0, None, 0, 0, none)]
    );
}

async fn stats_reject_bad_requests<H: Harness>(h: &H) {
    publish(h, plain(b"x", 0)).await;
    let ok = StatsRequest::new(secs(30));
    let bad = [
        (StatsRequest::new(Duration::ZERO), "lease_ttl"),
        (ok.clone().lease_ttl_for(Q, Duration::ZERO), "lease_ttl"),
        (ok.clone().lease_ttl_for("", secs(1)), "queue"),
        (ok.clone().queues(["", Q]), "queue"),
        (ok.clone().queues(["a\0b"]), "queue"),
        (ok.clone().queues(["q".repeat(256)]), "queue"),
        (
            ok.clone()
                .mode(StatsMode::Estimate)
                .queues(["q".repeat(256)]),
            "queue",
        ),
    ];
    for (request, field) in bad {
        let e = stats(h, &request).await.unwrap_err();
        assert_eq!(invalid_field(e), field, "{}: {request:?}", H::NAME);
    }
    assert_eq!(stats(h, &ok).await.unwrap().len(), 1);
}

/// A redriven dead letter is no longer counted as one: the statistics count
/// `redriven_at IS NULL`, and the redriven row is pending in its queue again.
async fn stats_do_not_count_redriven_dead_letters<H: Harness>(h: &H) {
    archive(h, Q, None, b"a", None, FailureReason::Rejected).await;
    let request = StatsRequest::new(TTL).queues([Q]);
    assert_eq!(
        stats(h, &request).await.unwrap(),
        [exact(Q, 0, 0, 0, 0, None, 0, 0, Count::Exact(1))]
    );
    let done = h.redrive(&Redrive::id(1)).await.unwrap();
    assert!(done[0].result.id().is_some(), "{done:?}");
    assert_eq!(
        stats(h, &request).await.unwrap(),
        [exact(Q, 1, 1, 0, 0, Some(0), 0, 0, Count::Exact(0))]
    );
}

contract! {
    stats_count_every_state_per_queue(dead_letter = true);
    stats_without_the_dead_letter_queue(dead_letter = false);
    stats_reject_bad_requests(dead_letter = true);
    stats_do_not_count_redriven_dead_letters(dead_letter = true);
}
