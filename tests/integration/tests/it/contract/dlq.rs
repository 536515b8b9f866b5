//! Dead letters (SPEC §1.2, §8): listed by filter and paged, redriven into their queue with
//! per-row outcomes, purged by age in batches, refused without the dead-letter queue.

use super::*;

async fn list<H: Harness>(
    h: &H,
    f: DeadLetterFilter,
    after: Option<i64>,
    limit: usize,
) -> Vec<i64> {
    h.list_dead_letters(&f, after, limit)
        .await
        .expect("list dead letters")
        .iter()
        .map(|d| d.id)
        .collect()
}

fn every() -> DeadLetterFilter {
    DeadLetterFilter::new()
}

fn outcome(dead_letter_id: i64, result: RedriveResult) -> RedriveOutcome {
    RedriveOutcome {
        dead_letter_id,
        result,
    }
}

fn redriven(dead_letter_id: i64, id: i64) -> RedriveOutcome {
    outcome(dead_letter_id, RedriveResult::Redriven { id })
}

/// The ids of the rows the redrives of a scenario made: as the scenario writes them, for
/// row ids that come from one sequence ([`Harness::ids_from_one_sequence`]), and as the store
/// gave them. With one sequence they must be equal. On a Citus cluster a redriven row's id
/// comes from the worker node's own range, so there the store's id is recorded (it must be
/// one no other redrive gave) and stands in wherever the scenario names the expected one.
struct RedrivenIds {
    one_sequence: bool,
    seen: std::cell::RefCell<std::collections::BTreeMap<i64, i64>>,
}

impl RedrivenIds {
    fn new<H: Harness>(h: &H) -> Self {
        Self {
            one_sequence: h.ids_from_one_sequence(),
            seen: Default::default(),
        }
    }

    /// The id the store gave the row the scenario expects as `id` (`id` itself unless a
    /// redrive gave another).
    fn id(&self, id: i64) -> i64 {
        self.seen.borrow().get(&id).copied().unwrap_or(id)
    }

    /// Checks a redrive's outcomes against `want`, written with one sequence's ids.
    #[track_caller]
    fn check(&self, got: Vec<RedriveOutcome>, want: &[RedriveOutcome]) {
        assert_eq!(got.len(), want.len(), "{got:?} against {want:?}");
        let mut expected = Vec::new();
        for (g, w) in got.iter().zip(want) {
            let result = match (&g.result, &w.result) {
                (
                    RedriveResult::Redriven { id: given },
                    RedriveResult::Redriven { id: written },
                ) if !self.one_sequence => {
                    let mut seen = self.seen.borrow_mut();
                    assert!(
                        *given > 0 && !seen.values().any(|v| v == given),
                        "a redrive gave id {given} twice or out of range: {got:?}"
                    );
                    seen.insert(*written, *given);
                    RedriveResult::Redriven { id: *given }
                }
                (
                    _,
                    RedriveResult::AlreadyRedriven {
                        redriven_id: Some(written),
                    },
                ) => RedriveResult::AlreadyRedriven {
                    redriven_id: Some(self.id(*written)),
                },
                (_, other) => *other,
            };
            expected.push(outcome(w.dead_letter_id, result));
        }
        assert_eq!(got, expected);
    }
}

async fn dead_letters_are_listed_by_filter_and_paged<H: Harness>(h: &H) {
    archive(h, Q, None, b"a", None, FailureReason::Rejected).await; // dlq 1 at 0 s
    h.advance(secs(10)).await;
    archive(h, Q2, None, b"b", None, FailureReason::RetryExhausted).await; // dlq 2 at 10 s
    h.advance(secs(10)).await;
    archive(h, Q, None, b"c", None, FailureReason::DecodeError).await; // dlq 3 at 20 s
    h.advance(secs(10)).await;
    archive(h, Q, None, b"d", None, FailureReason::Rejected).await; // dlq 4 at 30 s
    h.advance(secs(10)).await; // now 40 s

    let all = h.list_dead_letters(&every(), None, 100).await.unwrap();
    assert_eq!(all.iter().map(|d| d.id).collect::<Vec<_>>(), [1, 2, 3, 4]);
    assert_eq!(
        all[0],
        DeadLetter {
            id: 1,
            original_id: 1,
            queue: Q.to_owned(),
            payload: b"a".to_vec(),
            headers: None,
            raw_headers: None,
            timer_id: None,
            attempts_count: 1,
            deliveries_count: 1,
            created_at: at(0),
            failed_at: at(0),
            failure_reason: "rejected".to_owned(),
            last_error: Some("e".to_owned()),
            redriven_at: None,
            redriven_id: None,
        }
    );
    assert_eq!(list(h, every().queue(Q), None, 100).await, [1, 3, 4]);
    assert_eq!(
        list(
            h,
            every().queue(Q).reason(FailureReason::Rejected),
            None,
            100
        )
        .await,
        [1, 4]
    );
    assert_eq!(
        list(h, every().reason(FailureReason::RetryExhausted), None, 100).await,
        [2]
    );
    assert_eq!(
        list(
            h,
            every().failed_after(at(10)).failed_before(at(30)),
            None,
            100
        )
        .await,
        [2, 3],
        "half-open: from 10 s, before 30 s"
    );
    assert_eq!(list(h, every().failed_after(at(30)), None, 100).await, [4]);
    assert_eq!(list(h, every().failed_before(at(10)), None, 100).await, [1]);
    assert_eq!(
        list(h, every().older_than(secs(20)), None, 100).await,
        [1, 2],
        "older than 20 s at 40 s: before 20 s"
    );
    assert!(list(h, every().queue("nobody"), None, 100).await.is_empty());
    let millennium = secs(1000 * 366 * 24 * 3600);
    assert!(
        list(h, every().older_than(millennium), None, 100)
            .await
            .is_empty(),
        "the longest age is a time Postgres can compute"
    );

    // Keyset paging on the id.
    assert_eq!(list(h, every(), None, 2).await, [1, 2]);
    assert_eq!(list(h, every(), Some(2), 2).await, [3, 4]);
    assert!(list(h, every(), Some(4), 2).await.is_empty());
    assert_eq!(list(h, every().queue(Q), None, 2).await, [1, 3]);
    assert_eq!(list(h, every().queue(Q), Some(3), 2).await, [4]);
    assert!(list(h, every(), None, 0).await.is_empty());

    // Redriven rows are listed by default, with their link; `include_redriven(false)`
    // leaves them out.
    let redrives = RedrivenIds::new(h);
    redrives.check(h.redrive(&Redrive::id(1)).await.unwrap(), &[redriven(1, 5)]);
    let first = &h.list_dead_letters(&every(), None, 1).await.unwrap()[0];
    assert_eq!(
        (first.redriven_at, first.redriven_id),
        (Some(at(40)), Some(redrives.id(5)))
    );
    assert_eq!(list(h, every(), None, 100).await, [1, 2, 3, 4]);
    assert_eq!(
        list(h, every().include_redriven(false), None, 100).await,
        [2, 3, 4]
    );

    // Bad filters, before anything is read.
    let bad = |f: DeadLetterFilter| async move {
        invalid_field(h.list_dead_letters(&f, None, 10).await.unwrap_err())
    };
    assert_eq!(bad(every().queue("")).await, "queue");
    assert_eq!(bad(every().queue("q".repeat(256))).await, "queue");
    assert_eq!(
        bad(every().failed_after(at(30)).failed_before(at(10))).await,
        "failed_at",
        "inverted"
    );
    assert_eq!(
        bad(every().failed_after(at(10)).failed_before(at(10))).await,
        "failed_at",
        "empty"
    );
    assert_eq!(
        bad(every().older_than(millennium + secs(1))).await,
        "older_than"
    );
}

async fn redrive_publishes_dead_letters_again_into_their_queue<H: Harness>(h: &H) {
    let hs = headers(&[("trace", "t-1")]);
    publish(h, Message::new(Q, b"p1").timer_id("k1").headers(&hs)).await; // 1
    let d = claim_one(h).await;
    h.advance(secs(1)).await;
    h.store().retry(d.lease, Duration::ZERO).await.unwrap();
    h.advance(secs(1)).await;
    let d = claim_one(h).await;
    h.advance(secs(1)).await;
    h.store().fail(d.lease, rejected(Some("x"))).await.unwrap(); // dlq 1 at 3 s
    archive(h, Q2, None, b"p2", None, FailureReason::Rejected).await; // 2, dlq 2
    archive(h, Q, None, b"p3", None, FailureReason::Timeout).await; // 3, dlq 3
    archive(h, Q, None, b"p4", None, FailureReason::Rejected).await; // 4, dlq 4
    archive(h, Q, None, b"p5", None, FailureReason::Rejected).await; // 5, dlq 5
    h.advance(secs(7)).await; // 10 s

    // One: the original queue, payload, headers and key; fresh counters; due now.
    let redrives = RedrivenIds::new(h);
    let id = |n| redrives.id(n);
    redrives.check(h.redrive(&Redrive::id(1)).await.unwrap(), &[redriven(1, 6)]);
    let mut want_headers = hs.clone();
    want_headers.insert(REDRIVEN_FROM_HEADER.to_owned(), "1".to_owned());
    let new_row = StoredRow {
        headers: Some(want_headers),
        created_at: at(10),
        ..timer_row(id(6), "k1", b"p1", at(10))
    };
    assert_eq!(rows(h, Q).await, vec![new_row.clone()]);
    let letter = &h.list_dead_letters(&every(), None, 1).await.unwrap()[0];
    assert_eq!(
        (
            letter.attempts_count,
            letter.deliveries_count,
            letter.redriven_at,
            letter.redriven_id
        ),
        (2, 2, Some(at(10)), Some(id(6))),
        "the dead letter keeps its history and gains the link"
    );

    // Once only; unknown ids are reported, not skipped; an id named twice counts once.
    redrives.check(
        h.redrive(&Redrive::ids([99, 1, 1])).await.unwrap(),
        &[
            outcome(
                1,
                RedriveResult::AlreadyRedriven {
                    redriven_id: Some(6),
                },
            ),
            outcome(99, RedriveResult::NotFound),
        ],
    );
    assert_eq!(rows(h, Q).await, vec![new_row.clone()], "nothing new");
    assert!(h.redrive(&Redrive::ids([])).await.unwrap().is_empty());
    // Ids below 1 are a mistake, refused before any SQL (found by a trial run: they
    // were reported `NotFound`, unlike `run_now`'s).
    for bad in [0, -3] {
        let e = h.redrive(&Redrive::ids([1, bad])).await.unwrap_err();
        assert_eq!(invalid_field(e), "id");
    }

    // Many by filter, lowest ids first, up to the limit, never a redriven one.
    h.advance(secs(5)).await; // 15 s
    assert!(h
        .redrive(&Redrive::matching(every(), 0))
        .await
        .unwrap()
        .is_empty());
    redrives.check(
        h.redrive(&Redrive::matching(every().queue(Q), 2))
            .await
            .unwrap(),
        &[redriven(3, 7), redriven(4, 8)],
    );
    // include_redriven cannot make a redrive take a row twice.
    redrives.check(
        h.redrive(&Redrive::matching(every().include_redriven(true), 10))
            .await
            .unwrap(),
        &[redriven(2, 9), redriven(5, 10)],
    );
    assert!(h
        .redrive(&Redrive::matching(every(), 10))
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        rows(h, Q2).await,
        vec![StoredRow {
            headers: Some(headers(&[(REDRIVEN_FROM_HEADER, "2")])),
            created_at: at(15),
            ..row(id(9), Q2, b"p2", at(15))
        }]
    );
    assert!(list(h, every().include_redriven(false), None, 10)
        .await
        .is_empty());

    // The new rows are ordinary rows: claimed (delivery 1, no history) and completed.
    let got = claim(h, &[Q], 10).await;
    assert_eq!(ids(&got), [id(6), id(7), id(8), id(10)]);
    assert_eq!(
        (
            got[0].attempts_count,
            got[0].deliveries_count,
            got[0].timer_id.as_deref(),
            got[0]
                .headers
                .as_ref()
                .map(|h| h[REDRIVEN_FROM_HEADER].as_str())
        ),
        (0, 1, Some("k1"), Some("1"))
    );
    for d in &got {
        assert_eq!(h.store().ack(d.lease).await.unwrap(), Completion::Deleted);
    }
    let next = publish(h, Message::new(Q, b"next")).await;
    if h.ids_from_one_sequence() {
        assert_eq!(
            next,
            Published::Inserted { id: 11 },
            "every redrive used up exactly one id"
        );
    }
}

async fn redrive_gives_per_row_outcomes_and_leaves_refused_rows_alone<H: Harness>(h: &H) {
    archive(h, Q, Some("held"), b"h", None, FailureReason::Rejected).await; // 1, dlq 1
    assert_eq!(
        publish(h, schedule("held", b"live", secs(60))).await,
        Published::Inserted { id: 2 },
        "the key is scheduled again"
    );
    let live = only_row(h).await;
    let raw = |json: &str| DeadLetter {
        id: 0,
        original_id: 1000,
        queue: Q.to_owned(),
        payload: b"r".to_vec(),
        headers: None,
        raw_headers: Some(json.to_owned()),
        timer_id: None,
        attempts_count: 0,
        deliveries_count: 1,
        created_at: at(0),
        failed_at: at(0),
        failure_reason: "decode_error".to_owned(),
        last_error: Some("headers".to_owned()),
        redriven_at: None,
        redriven_id: None,
    };
    assert_eq!(h.insert_dead_letter(raw(r#"["not","a","map"]"#)).await, 2);
    assert_eq!(h.insert_dead_letter(raw(r#"{"n":1}"#)).await, 3);
    // Headers 5 bytes under the limit: the redrive header (20 + 1 bytes) pushes them over.
    let big = headers(&[("k", &"v".repeat(MAX_HEADERS_BYTES - 6))]);
    archive(h, Q, None, b"big", Some(&big), FailureReason::Rejected).await; // 3, dlq 4
    archive(h, Q, None, b"ok", None, FailureReason::Rejected).await; // 4, dlq 5
    let before = h.list_dead_letters(&every(), None, 10).await.unwrap();
    assert_eq!(before.len(), 5);
    assert_eq!(
        before[1].raw_headers.as_deref(),
        Some(r#"["not","a","map"]"#)
    );

    let redrives = RedrivenIds::new(h);
    redrives.check(
        h.redrive(&Redrive::ids(1..=5)).await.unwrap(),
        &[
            outcome(1, RedriveResult::TimerKeyHeld),
            outcome(2, RedriveResult::HeadersNotAMap),
            outcome(3, RedriveResult::HeadersNotAMap),
            outcome(
                4,
                RedriveResult::HeadersTooLarge {
                    bytes: MAX_HEADERS_BYTES + 16,
                },
            ),
            // The held key was left out before the INSERT: it used up no id (issue 27).
            redriven(5, 5),
        ],
    );
    let after = h.list_dead_letters(&every(), None, 10).await.unwrap();
    assert_eq!(
        after[..4],
        before[..4],
        "refused rows are left as they were"
    );
    assert_eq!(
        rows(h, Q).await,
        vec![
            StoredRow {
                headers: Some(headers(&[(REDRIVEN_FROM_HEADER, "5")])),
                ..row(redrives.id(5), Q, b"ok", at(0))
            },
            live.clone(),
        ],
        "the live timer is untouched"
    );

    // Once the key is free, the dead letter can go back.
    assert_eq!(
        h.cancel(Q, "held").await.unwrap(),
        Cancelled::Deleted { id: 2 }
    );
    redrives.check(h.redrive(&Redrive::id(1)).await.unwrap(), &[redriven(1, 6)]);

    // Two dead letters of one key in one redrive: the lower id goes back, the other finds
    // the key held by it, and uses up no id.
    archive(h, Q2, Some("dup"), b"d1", None, FailureReason::Rejected).await; // 7, dlq 6
    archive(h, Q2, Some("dup"), b"d2", None, FailureReason::Rejected).await; // 8, dlq 7
    redrives.check(
        h.redrive(&Redrive::matching(every().queue(Q2), 10))
            .await
            .unwrap(),
        &[redriven(6, 9), outcome(7, RedriveResult::TimerKeyHeld)],
    );
    assert_eq!(
        rows(h, Q2)
            .await
            .iter()
            .map(|r| (r.id, r.payload.clone()))
            .collect::<Vec<_>>(),
        [(redrives.id(9), b"d1".to_vec())]
    );
    let next = publish(h, Message::new(Q3, b"next")).await;
    if h.ids_from_one_sequence() {
        assert_eq!(next, Published::Inserted { id: 10 });
    }
}

async fn a_redrive_wakes_workers_once_per_queue<H: Harness>(h: &H) {
    archive(h, Q, None, b"a", None, FailureReason::Rejected).await;
    archive(h, Q, None, b"b", None, FailureReason::Rejected).await;
    archive(h, Q2, None, b"c", None, FailureReason::Rejected).await;
    h.advance(secs(5)).await;
    let mut hints = h
        .store()
        .wakeups()
        .await
        .unwrap()
        .expect("both stores push hints");
    let done = h.redrive(&Redrive::ids([1, 2, 3])).await.unwrap();
    RedrivenIds::new(h).check(done, &[redriven(1, 4), redriven(2, 5), redriven(3, 6)]);
    publish(h, Message::new(Q3, b"marker").schedule(secs(1))).await;
    let hint = |queue: &str, at: DateTime<Utc>| Wakeup::Published {
        queue: queue.to_owned(),
        at,
    };
    let mut got = next_hints(&mut hints, 3).await;
    // The queues of one statement notify in no particular order; the marker comes last.
    let marker = got.pop();
    assert_eq!(marker, Some(hint(Q3, at(6))));
    got.sort_by_key(|w| format!("{w:?}"));
    assert_eq!(got, [hint(Q, at(5)), hint(Q2, at(5))]);
}

async fn dead_letters_are_purged_by_age_in_batches<H: Harness>(h: &H) {
    archive(h, Q, None, b"a", None, FailureReason::Rejected).await; // dlq 1 at 0 s
    h.advance(secs(10)).await;
    archive(h, Q2, None, b"b", None, FailureReason::Rejected).await; // dlq 2 at 10 s
    h.advance(secs(10)).await;
    archive(h, Q, None, b"c", None, FailureReason::Rejected).await; // dlq 3 at 20 s
    h.advance(secs(10)).await;
    archive(h, Q, None, b"d", None, FailureReason::Rejected).await; // dlq 4 at 30 s
    RedrivenIds::new(h).check(h.redrive(&Redrive::id(1)).await.unwrap(), &[redriven(1, 5)]);
    h.advance(secs(10)).await; // 40 s

    let bad = |f: DeadLetterFilter, batch: usize| async move {
        invalid_field(h.purge_dead_letters(&f, batch).await.unwrap_err())
    };
    assert_eq!(bad(every().queue(Q), 10).await, "filter", "no age bound");
    assert_eq!(bad(every().older_than(secs(1)), 0).await, "batch_size");
    assert_eq!(
        bad(every().queue("").older_than(secs(1)), 10).await,
        "queue"
    );
    assert_eq!(list(h, every(), None, 10).await, [1, 2, 3, 4]);

    let purge = |f: DeadLetterFilter, batch: usize| async move {
        h.purge_dead_letters(&f, batch).await.expect("purge")
    };
    assert_eq!(
        purge(every().older_than(secs(25)).include_redriven(false), 10).await,
        1,
        "before 15 s and not redriven: dlq 2 only"
    );
    assert_eq!(list(h, every(), None, 10).await, [1, 3, 4]);
    assert_eq!(
        purge(every().older_than(secs(25)), 1).await,
        1,
        "batches of one: the redriven dlq 1"
    );
    assert_eq!(purge(every().failed_before(at(30)).queue(Q2), 10).await, 0);
    assert_eq!(list(h, every(), None, 10).await, [3, 4]);
    archive(h, Q2, None, b"e", None, FailureReason::Rejected).await; // dlq 5 at 40 s
    assert_eq!(
        purge(every().older_than(secs(10)), 1).await,
        1,
        "before 30 s: dlq 3; dlq 4 at exactly 30 s stays"
    );
    h.advance(Duration::from_micros(1)).await;
    assert_eq!(
        purge(every().failed_before(at(50)), 1).await,
        2,
        "two batches"
    );
    assert!(list(h, every(), None, 10).await.is_empty());
    assert_eq!(rows(h, Q).await.len(), 1, "the redriven row lives on");
}

async fn dead_letter_operations_refuse_without_the_dead_letter_queue<H: Harness>(h: &H) {
    assert!(!h.store().dead_letter_enabled());
    let off = |e: Error| assert!(matches!(e, Error::DeadLetterDisabled), "{e:?}");
    off(h.list_dead_letters(&every(), None, 10).await.unwrap_err());
    // The setting is checked first, before the arguments.
    off(h
        .list_dead_letters(&every().queue(""), None, 10)
        .await
        .unwrap_err());
    off(h.redrive(&Redrive::id(1)).await.unwrap_err());
    off(h
        .redrive(&Redrive::matching(every(), 10))
        .await
        .unwrap_err());
    off(h
        .purge_dead_letters(&every().older_than(secs(1)), 10)
        .await
        .unwrap_err());
    assert!(format!("{:?}", Error::DeadLetterDisabled).contains("dead_letter(true)"));
}

contract! {
    dead_letters_are_listed_by_filter_and_paged(dead_letter = true);
    redrive_publishes_dead_letters_again_into_their_queue(dead_letter = true);
    redrive_gives_per_row_outcomes_and_leaves_refused_rows_alone(dead_letter = true);
    a_redrive_wakes_workers_once_per_queue(dead_letter = true);
    dead_letters_are_purged_by_age_in_batches(dead_letter = true);
    dead_letter_operations_refuse_without_the_dead_letter_queue(dead_letter = false);
}
