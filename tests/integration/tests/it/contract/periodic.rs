//! Periodic timers (SPEC §9.1): arming the next instant at the start of a run, fenced by the
//! token; registration of a schedule and of a changed one.

use super::*;

const SCHED: &str = "schedule:nightly";

/// A schedule's headers: the fingerprint of schedule `fp`, one letter naming an interval
/// (`"A"` is every 1 s, `"B"` every 2 s, …), or none at all for `""`.
fn fingerprint(fp: &str) -> Headers {
    let text = match fp.as_bytes() {
        [] => String::new(),
        [letter] => format!("every:{}s", letter - b'A' + 1),
        _ => panic!("one letter: {fp:?}"),
    };
    headers(&[(SCHEDULE_HEADER, &text)])
}

async fn register<H: Harness>(h: &H, payload: &[u8], fp: &str, first: DateTime<Utc>) -> Registered {
    let hs = fingerprint(fp);
    h.store()
        .register_schedule(RegisterSchedule::new(Q, SCHED, payload, &hs, first))
        .await
        .expect("register")
}

/// The pending row of the schedule as registered at `at(0)`.
fn schedule_row(id: i64, payload: &[u8], fp: &str, due: DateTime<Utc>) -> StoredRow {
    StoredRow {
        headers: Some(fingerprint(fp)),
        ..timer_row(id, SCHED, payload, due)
    }
}

/// `r` with the rearm `arm_next` or a registration queues.
fn armed(r: StoredRow, rearm_at: DateTime<Utc>, payload: &[u8], fp: &str) -> StoredRow {
    StoredRow {
        rearm_headers: Some(fingerprint(fp)),
        ..with_rearm(r, rearm_at, payload)
    }
}

async fn arm_next_queues_the_next_instant_fenced_by_the_token<H: Harness>(h: &H) {
    assert_eq!(
        register(h, b"s", "A", at(0)).await,
        Registered::Inserted { id: 1, at: at(0) }
    );
    h.advance(secs(5)).await;
    let d = claim_one(h).await;
    let running = leased(schedule_row(1, b"s", "A", at(0)), &d, at(5), 1);
    assert_eq!(
        h.store().arm_next(wrong(d.lease), at(60)).await.unwrap(),
        Armed::LeaseLost
    );
    assert_eq!(only_row(h).await, running, "a wrong token writes nothing");
    assert_eq!(
        h.store().arm_next(d.lease, at(60)).await.unwrap(),
        Armed::Queued { at: at(60) }
    );
    assert_eq!(
        only_row(h).await,
        armed(running.clone(), at(60), b"s", "A"),
        "the row's own payload and headers"
    );
    // A queued rearm of the same schedule that is not earlier stays (a reclaimed run
    // finds the one its crashed predecessor queued).
    for earlier_or_same in [at(30), at(60)] {
        assert_eq!(
            h.store().arm_next(d.lease, earlier_or_same).await.unwrap(),
            Armed::Kept { at: at(60) }
        );
    }
    // An earlier one is replaced by the later next instant.
    assert_eq!(
        h.store().arm_next(d.lease, at(90)).await.unwrap(),
        Armed::Queued { at: at(90) }
    );
    assert_eq!(only_row(h).await, armed(running, at(90), b"s", "A"));
    // Success applies it unchanged: the next instance, pending at the next instant.
    assert_eq!(
        h.store().ack(d.lease).await.unwrap(),
        Completion::Rearmed { at: at(90) }
    );
    assert_eq!(only_row(h).await, schedule_row(1, b"s", "A", at(90)));
    assert_eq!(
        h.store().arm_next(d.lease, at(120)).await.unwrap(),
        Armed::LeaseLost,
        "an unleased row is never armed"
    );
    assert_eq!(only_row(h).await, schedule_row(1, b"s", "A", at(90)));
}

async fn schedule_keys_are_reserved_for_registrations<H: Harness>(h: &H) {
    register(h, b"s", "A", at(0)).await;
    // A publish or extend of a `schedule:` key (the registered one or any other) is
    // refused before anything is written: only registrations write those rows.
    for message in [
        extend(SCHED, b"user", at(500)),
        schedule(SCHED, b"user", at(500)),
        Message::new(Q, b"user").timer_id("schedule:other"),
    ] {
        let e = h.publish(message).await.unwrap_err();
        assert_eq!(invalid_field(e), "timer_id", "{}", H::NAME);
    }
    let d = claim_one(h).await;
    let running = leased(schedule_row(1, b"s", "A", at(0)), &d, at(0), 1);
    let e = h
        .publish(extend(SCHED, b"user", at(500)))
        .await
        .unwrap_err();
    assert_eq!(invalid_field(e), "timer_id", "{}", H::NAME);
    assert_eq!(only_row(h).await, running, "nothing written");
    // Keys that only contain the prefix elsewhere are ordinary.
    assert!(matches!(
        publish(h, schedule("my-schedule:x", b"v", at(10))).await,
        Published::Inserted { .. }
    ));
}

async fn arm_next_never_arms_nor_clears_a_cancelled_row<H: Harness>(h: &H) {
    register(h, b"s", "A", at(0)).await;
    let d = claim_one(h).await;
    let running = leased(schedule_row(1, b"s", "A", at(0)), &d, at(0), 1);
    assert_eq!(
        h.cancel(Q, SCHED).await.unwrap(),
        Cancelled::Running { id: 1 }
    );
    assert_eq!(
        h.store().arm_next(d.lease, at(60)).await.unwrap(),
        Armed::Cancelled
    );
    assert_eq!(
        only_row(h).await,
        StoredRow {
            cancelled_at: Some(at(0)),
            ..running
        },
        "no rearm, the mark kept"
    );
    // The schedule stops: the run's end deletes the row.
    assert_eq!(h.store().ack(d.lease).await.unwrap(), Completion::Deleted);
    assert!(rows(h, Q).await.is_empty());
    // ... until the next registration, which inserts it again (id 2: the identity).
    assert_eq!(
        register(h, b"s", "A", at(60)).await,
        Registered::Inserted { id: 2, at: at(60) }
    );

    // A cancel after the next instant was armed drops it: the schedule stops too.
    h.advance(secs(60)).await;
    let d = claim_one(h).await;
    h.store().arm_next(d.lease, at(120)).await.unwrap();
    assert_eq!(
        h.cancel(Q, SCHED).await.unwrap(),
        Cancelled::RearmDropped { id: 2 }
    );
    assert_eq!(
        h.store().fail(d.lease, rejected(None)).await.unwrap(),
        Completion::Cancelled
    );
    assert!(rows(h, Q).await.is_empty());
    assert!(dead_letters(h).await.is_empty());
}

async fn registration_inserts_once_and_follows_a_changed_schedule<H: Harness>(h: &H) {
    assert_eq!(
        register(h, b"a", "A", at(60)).await,
        Registered::Inserted { id: 1, at: at(60) }
    );
    // The same fingerprint and payload: nothing written, whatever the first instant.
    assert_eq!(register(h, b"a", "A", at(10)).await, Registered::Unchanged);
    assert_eq!(register(h, b"a", "A", at(100)).await, Registered::Unchanged);
    assert_eq!(only_row(h).await, schedule_row(1, b"a", "A", at(60)));
    // Another fingerprint moves a pending row, earlier too, with the new payload.
    assert_eq!(
        register(h, b"b", "B", at(30)).await,
        Registered::Rescheduled { id: 1, at: at(30) }
    );
    assert_eq!(only_row(h).await, schedule_row(1, b"b", "B", at(30)));

    // A pending row waiting for a retry: moved, retry history reset, deliveries kept.
    h.advance(secs(30)).await;
    let d = claim_one(h).await;
    h.store().retry(d.lease, secs(10)).await.unwrap();
    assert_eq!(
        register(h, b"c", "C", at(35)).await,
        Registered::Rescheduled { id: 1, at: at(35) }
    );
    assert_eq!(
        only_row(h).await,
        StoredRow {
            deliveries_count: 1,
            ..schedule_row(1, b"c", "C", at(35))
        }
    );

    // A running row of the same schedule, no rearm yet: unchanged (its run arms the next).
    h.advance(secs(5)).await;
    let d = claim_one(h).await;
    assert_eq!(register(h, b"c", "C", at(70)).await, Registered::Unchanged);
    let running = leased(
        StoredRow {
            deliveries_count: 1,
            ..schedule_row(1, b"c", "C", at(35))
        },
        &d,
        at(35),
        2,
    );
    assert_eq!(only_row(h).await, running);
    assert_eq!(
        h.store().arm_next(d.lease, at(100)).await.unwrap(),
        Armed::Queued { at: at(100) }
    );
    // Another fingerprint replaces the queued rearm, earlier allowed.
    assert_eq!(
        register(h, b"d", "D", at(50)).await,
        Registered::RearmReplaced { id: 1, at: at(50) }
    );
    assert_eq!(only_row(h).await, armed(running.clone(), at(50), b"d", "D"));
    // The same fingerprint as the queued rearm: unchanged.
    assert_eq!(register(h, b"d", "D", at(40)).await, Registered::Unchanged);
    // A run of the old schedule arming its next instant keeps the registration's rearm.
    assert_eq!(
        h.store().arm_next(d.lease, at(100)).await.unwrap(),
        Armed::Kept { at: at(50) }
    );
    assert_eq!(only_row(h).await, armed(running, at(50), b"d", "D"));
    assert_eq!(
        h.store().ack(d.lease).await.unwrap(),
        Completion::Rearmed { at: at(50) }
    );
    assert_eq!(only_row(h).await, schedule_row(1, b"d", "D", at(50)));
}

async fn registration_brings_a_changed_payload_and_keeps_the_timing<H: Harness>(h: &H) {
    register(h, b"a", "A", at(60)).await;
    // A pending row waiting for a retry: the new payload, its deadline kept, retry history
    // reset (a fixed payload deserves fresh counts), deliveries kept.
    h.advance(secs(60)).await;
    let d = claim_one(h).await;
    h.store().retry(d.lease, secs(10)).await.unwrap();
    assert_eq!(
        register(h, b"b", "A", at(500)).await,
        Registered::Rescheduled { id: 1, at: at(70) }
    );
    assert_eq!(
        only_row(h).await,
        StoredRow {
            deliveries_count: 1,
            ..schedule_row(1, b"b", "A", at(70))
        }
    );
    assert_eq!(register(h, b"b", "A", at(500)).await, Registered::Unchanged);

    // A running row whose run armed its next instant: the rearm gets the new payload and
    // keeps its deadline; the run's end applies it.
    h.advance(secs(10)).await;
    let d = claim_one(h).await;
    let running = leased(
        StoredRow {
            deliveries_count: 1,
            ..schedule_row(1, b"b", "A", at(70))
        },
        &d,
        at(70),
        2,
    );
    h.store().arm_next(d.lease, at(130)).await.unwrap();
    assert_eq!(
        register(h, b"c", "A", at(500)).await,
        Registered::RearmReplaced { id: 1, at: at(130) }
    );
    assert_eq!(
        only_row(h).await,
        armed(running.clone(), at(130), b"c", "A")
    );
    assert_eq!(register(h, b"c", "A", at(500)).await, Registered::Unchanged);
    assert_eq!(
        h.store().ack(d.lease).await.unwrap(),
        Completion::Rearmed { at: at(130) }
    );
    assert_eq!(only_row(h).await, schedule_row(1, b"c", "A", at(130)));

    // A running row with no rearm yet: the first instant is queued with the new payload,
    // and the run's own next instant, not later, keeps it.
    h.advance(secs(60)).await;
    let d = claim_one(h).await;
    let running = leased(schedule_row(1, b"c", "A", at(130)), &d, at(130), 1);
    assert_eq!(
        register(h, b"d", "A", at(190)).await,
        Registered::RearmReplaced { id: 1, at: at(190) }
    );
    assert_eq!(
        only_row(h).await,
        armed(running.clone(), at(190), b"d", "A")
    );
    assert_eq!(
        h.store().arm_next(d.lease, at(190)).await.unwrap(),
        Armed::Kept { at: at(190) }
    );
    assert_eq!(only_row(h).await, armed(running, at(190), b"d", "A"));
}

async fn a_changed_schedule_keeps_an_overdue_instant<H: Harness>(h: &H) {
    register(h, b"a", "A", at(10)).await;
    // Workers were down past the instant: the new schedule takes the row (payload,
    // headers) but the missed instant keeps its deadline and fires at once.
    h.advance(secs(20)).await;
    assert_eq!(
        register(h, b"b", "B", at(25)).await,
        Registered::Rescheduled { id: 1, at: at(10) }
    );
    assert_eq!(only_row(h).await, schedule_row(1, b"b", "B", at(10)));
    let d = claim_one(h).await;
    assert_eq!((d.deadline, d.payload.as_slice()), (at(10), &b"b"[..]));
    // Not overdue: moved to the new first instant, later too.
    h.store().arm_next(d.lease, at(40)).await.unwrap();
    h.store().ack(d.lease).await.unwrap();
    assert_eq!(
        register(h, b"c", "C", at(90)).await,
        Registered::Rescheduled { id: 1, at: at(90) }
    );
}

async fn a_redriven_instant_runs_once_without_restarting_its_schedule<H: Harness>(h: &H) {
    register(h, b"s", "A", at(0)).await;
    let d = claim_one(h).await;
    h.store().arm_next(d.lease, at(60)).await.unwrap();
    assert_eq!(
        h.store()
            .fail(d.lease, rejected(Some("boom")))
            .await
            .unwrap(),
        Completion::Rearmed { at: at(60) }
    );
    let letters = dead_letters(h).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].timer_id.as_deref(), Some(SCHED));
    // The schedule's row is live, and the redrive is not refused for it: the instant goes
    // back as a one-off message, without the key and the fingerprint.
    let outcomes = h.redrive(&Redrive::id(letters[0].id)).await.unwrap();
    let [RedriveOutcome {
        result: RedriveResult::Redriven { id },
        ..
    }] = outcomes[..]
    else {
        panic!("{}: {outcomes:?}", H::NAME);
    };
    let again = rows(h, Q).await;
    let one_off = again.iter().find(|r| r.id == id).expect("the one-off row");
    assert_eq!(one_off.timer_id, None);
    assert_eq!(
        one_off.headers,
        Some(headers(&[(
            REDRIVEN_FROM_HEADER,
            &letters[0].id.to_string()
        )]))
    );
    assert_eq!(
        (one_off.payload.as_slice(), one_off.next_attempt_at),
        (&b"s"[..], at(0))
    );
    let schedule = again
        .iter()
        .find(|r| r.id != id)
        .expect("the schedule's row");
    assert_eq!(*schedule, schedule_row(1, b"s", "A", at(60)));
    // The two are independent: cancelling the schedule leaves the one-off row, which runs
    // once and is gone.
    assert_eq!(
        h.cancel(Q, SCHED).await.unwrap(),
        Cancelled::Deleted { id: 1 }
    );
    h.store().ack(claim_one(h).await.lease).await.unwrap();
    assert!(rows(h, Q).await.is_empty());
}

async fn registration_after_a_cancel_restarts_the_schedule<H: Harness>(h: &H) {
    // A pending row deleted by a cancel: inserted again.
    register(h, b"s", "A", at(10)).await;
    assert_eq!(
        h.cancel(Q, SCHED).await.unwrap(),
        Cancelled::Deleted { id: 1 }
    );
    assert_eq!(
        register(h, b"s", "A", at(10)).await,
        Registered::Inserted { id: 2, at: at(10) }
    );
    // A running row a cancel marked: the same schedule queues its first instant as the
    // rearm and clears the mark; the run's end applies it.
    h.advance(secs(10)).await;
    let d = claim_one(h).await;
    h.store().arm_next(d.lease, at(20)).await.unwrap();
    h.cancel(Q, SCHED).await.unwrap();
    assert_eq!(
        register(h, b"s", "A", at(30)).await,
        Registered::RearmReplaced { id: 2, at: at(30) }
    );
    let row = only_row(h).await;
    assert_eq!(
        (row.cancelled_at, row.rearm_at),
        (None, Some(at(30))),
        "{row:#?}"
    );
    assert_eq!(register(h, b"s", "A", at(40)).await, Registered::Unchanged);
    assert_eq!(
        h.store().renew(&[d.lease]).await.unwrap(),
        vec![Renewal::Renewed],
        "no longer cancelled"
    );
    assert_eq!(
        h.store().retry(d.lease, secs(3600)).await.unwrap(),
        Completion::Rearmed { at: at(30) }
    );
    assert_eq!(only_row(h).await.next_attempt_at, at(30));
}

async fn an_armed_instant_survives_every_way_a_run_ends<H: Harness>(h: &H) {
    register(h, b"s", "A", at(0)).await;
    // A retry yields to the next instant: history updated, deliveries kept.
    let d = claim_one(h).await;
    h.store().arm_next(d.lease, at(60)).await.unwrap();
    assert_eq!(
        h.store().retry(d.lease, secs(3600)).await.unwrap(),
        Completion::Rearmed { at: at(60) }
    );
    assert_eq!(
        only_row(h).await,
        StoredRow {
            attempts_count: 1,
            deliveries_count: 1,
            first_attempt_at: Some(at(0)),
            last_attempt_at: Some(at(0)),
            ..schedule_row(1, b"s", "A", at(60))
        }
    );
    // A terminal failure with the dead-letter queue: archived and re-armed.
    h.advance(secs(60)).await;
    let d = claim_one(h).await;
    h.store().arm_next(d.lease, at(120)).await.unwrap();
    assert_eq!(
        h.store().fail(d.lease, rejected(Some("no"))).await.unwrap(),
        Completion::Rearmed { at: at(120) }
    );
    assert_eq!(only_row(h).await, schedule_row(1, b"s", "A", at(120)));
    let dlq = dead_letters(h).await;
    assert_eq!(dlq.len(), 1, "{dlq:#?}");
    assert_eq!(
        (dlq[0].payload.as_slice(), dlq[0].timer_id.as_deref()),
        (&b"s"[..], Some(SCHED))
    );
    // A crash: the reclaiming run arms the same instant; it stays queued and applies once.
    h.advance(secs(60)).await;
    let stale = claim_one(h).await;
    h.store().arm_next(stale.lease, at(180)).await.unwrap();
    h.advance(TTL + secs(1)).await;
    let fresh = claim_one(h).await;
    assert_eq!(
        h.store().arm_next(fresh.lease, at(180)).await.unwrap(),
        Armed::Kept { at: at(180) }
    );
    assert_eq!(
        h.store().ack(stale.lease).await.unwrap(),
        Completion::LeaseLost
    );
    assert_eq!(
        h.store().ack(fresh.lease).await.unwrap(),
        Completion::Rearmed { at: at(180) }
    );
    assert_eq!(only_row(h).await, schedule_row(1, b"s", "A", at(180)));
}

async fn an_armed_instant_survives_a_terminal_failure_without_dead_letters<H: Harness>(h: &H) {
    register(h, b"s", "A", at(0)).await;
    let d = claim_one(h).await;
    h.store().arm_next(d.lease, at(60)).await.unwrap();
    let max = Failure {
        reason: FailureReason::MaxDeliveries,
        last_error: None,
    };
    assert_eq!(
        h.store().fail(d.lease, max).await.unwrap(),
        Completion::Rearmed { at: at(60) }
    );
    assert_eq!(only_row(h).await, schedule_row(1, b"s", "A", at(60)));
}

async fn registration_rejects_bad_requests_before_writing<H: Harness>(h: &H) {
    let good = fingerprint("A");
    let empty = fingerprint("");
    let none = headers(&[("other", "x")]);
    let unreadable = headers(&[(SCHEDULE_HEADER, "every 300s")]);
    let not_canonical = headers(&[(SCHEDULE_HEADER, "every:0300s")]);
    let long = "q".repeat(256);
    let cases: [(RegisterSchedule<'_>, &str); 9] = [
        (
            RegisterSchedule::new("", SCHED, b"s", &good, at(0)),
            "queue",
        ),
        (
            RegisterSchedule::new(&long, SCHED, b"s", &good, at(0)),
            "queue",
        ),
        (
            RegisterSchedule::new(Q, "nightly", b"s", &good, at(0)),
            "timer_id",
        ),
        (
            RegisterSchedule::new(Q, "schedule:", b"s", &good, at(0)),
            "timer_id",
        ),
        (
            RegisterSchedule::new(Q, SCHED, b"s", &none, at(0)),
            "headers",
        ),
        (
            RegisterSchedule::new(Q, SCHED, b"s", &empty, at(0)),
            "headers",
        ),
        (
            RegisterSchedule::new(Q, SCHED, b"s", &unreadable, at(0)),
            "headers",
        ),
        (
            RegisterSchedule::new(Q, SCHED, b"s", &not_canonical, at(0)),
            "headers",
        ),
        (
            RegisterSchedule::new(Q, SCHED, b"s", &good, DateTime::<Utc>::MIN_UTC),
            "first",
        ),
    ];
    for (request, field) in cases {
        let e = h.store().register_schedule(request).await.unwrap_err();
        assert_eq!(invalid_field(e), field, "{}: {request:?}", H::NAME);
    }
    assert!(rows(h, Q).await.is_empty());
    register(h, b"s", "A", at(0)).await;
    let d = claim_one(h).await;
    let e = h
        .store()
        .arm_next(d.lease, DateTime::<Utc>::MIN_UTC)
        .await
        .unwrap_err();
    assert_eq!(invalid_field(e), "at");
    assert_eq!(only_row(h).await.rearm_at, None);
}

async fn registrations_that_make_a_row_due_send_a_wakeup_hint<H: Harness>(h: &H) {
    let mut hints = h
        .store()
        .wakeups()
        .await
        .unwrap()
        .expect("both stores push hints");
    register(h, b"s", "A", at(10)).await; // inserted: a hint
    register(h, b"s", "A", at(5)).await; // unchanged: none
    register(h, b"s", "B", at(3)).await; // a pending row moved: a hint
    h.advance(secs(3)).await;
    let d = claim_one(h).await;
    // A rearm replaced on a running row: no hint (its completion sends one).
    assert_eq!(
        register(h, b"s", "C", at(50)).await,
        Registered::RearmReplaced { id: 1, at: at(50) }
    );
    h.store().ack(d.lease).await.unwrap();
    publish(h, Message::new(Q3, b"marker")).await;
    let hint = |queue: &str, at: DateTime<Utc>| Wakeup::Published {
        queue: queue.to_owned(),
        at,
    };
    let want = vec![
        hint(Q, at(10)),
        hint(Q, at(3)),
        hint(Q, at(50)),
        hint(Q3, at(3)),
    ];
    let got = next_hints(&mut hints, want.len()).await;
    assert_eq!(got, want);
}

contract! {
    arm_next_queues_the_next_instant_fenced_by_the_token(dead_letter = true);
    schedule_keys_are_reserved_for_registrations(dead_letter = true);
    arm_next_never_arms_nor_clears_a_cancelled_row(dead_letter = true);
    registration_inserts_once_and_follows_a_changed_schedule(dead_letter = true);
    registration_brings_a_changed_payload_and_keeps_the_timing(dead_letter = true);
    a_changed_schedule_keeps_an_overdue_instant(dead_letter = true);
    a_redriven_instant_runs_once_without_restarting_its_schedule(dead_letter = true);
    registration_after_a_cancel_restarts_the_schedule(dead_letter = true);
    an_armed_instant_survives_every_way_a_run_ends(dead_letter = true);
    an_armed_instant_survives_a_terminal_failure_without_dead_letters(dead_letter = false);
    registration_rejects_bad_requests_before_writing(dead_letter = true);
    registrations_that_make_a_row_due_send_a_wakeup_hint(dead_letter = true);
}
