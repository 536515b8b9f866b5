//! Fair across claims (SPEC §6 v3): each round of a claim starts after
//! `ClaimRequest::resume_after`, so a claimer that passes the queue of its previous claim's
//! last row serves every queue with due rows within `n` claims (`n` queues), whatever the
//! claim size and however old the other queues' backlogs. Queues of a round come in name
//! order: `Q` (`q.main`) < `Q2` (`q.other`) < `Q3` (`q.third`).

use super::*;

/// The label of a claimed row: its payload, published as text.
fn label(d: &Delivery) -> String {
    String::from_utf8(d.payload.clone()).expect("a text payload")
}

/// Publishes one row on `queue` per label, due now, one second apart (distinct deadlines,
/// so both stores agree on each queue's order without relying on ties).
async fn backlog<H: Harness>(h: &H, queue: &str, labels: &[&str]) {
    for l in labels {
        publish(h, Message::new(queue, l.as_bytes())).await;
        h.advance(secs(1)).await;
    }
}

/// One claim of `limit` rows of `queues`, starting its rounds after `resume_after`.
async fn claim_after<H: Harness>(
    h: &H,
    queues: &[&str],
    limit: usize,
    resume_after: Option<&str>,
) -> Vec<Delivery> {
    let queues: Vec<String> = queues.iter().map(|q| (*q).to_owned()).collect();
    let mut request = ClaimRequest::new(&queues, limit, TTL);
    if let Some(r) = resume_after {
        request = request.resume_after(r);
    }
    h.store().claim(request).await.expect("claim")
}

/// Claims as a worker does until a claim comes back empty: `limit` rows at a time, each
/// claim resuming after the queue of the previous claim's last row (the first after
/// nothing). The labels, one list per claim.
async fn drain<H: Harness>(h: &H, queues: &[&str], limit: usize) -> Vec<Vec<String>> {
    let mut claims = Vec::new();
    let mut last: Option<String> = None;
    loop {
        let got = claim_after(h, queues, limit, last.as_deref()).await;
        let Some(end) = got.last() else {
            return claims;
        };
        last = Some(end.queue.clone());
        claims.push(got.iter().map(label).collect());
    }
}

fn labels(claims: &[&[&str]]) -> Vec<Vec<String>> {
    claims
        .iter()
        .map(|c| c.iter().map(|l| (*l).to_owned()).collect())
        .collect()
}

/// Issue 26's case: queue `a` holds 30 rows due ten minutes ago, `b` one row due now, one
/// row per claim. Without rotation every claim takes `a`'s oldest row and `b`'s runs 31st;
/// with it, `b`'s runs 2nd.
async fn a_fresh_row_is_not_held_back_by_an_old_backlog_one_row_a_claim<H: Harness>(h: &H) {
    let a: Vec<String> = (1..=30).map(|i| format!("a{i}")).collect();
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    backlog(h, "a", &a).await;
    h.advance(secs(600)).await;
    publish(h, Message::new("b", b"b1")).await;

    // The fault: a claim that starts every round at the same queue takes `a` every time.
    let first = claim_after(h, &["a", "b"], 1, None).await;
    assert_eq!(first.iter().map(label).collect::<Vec<_>>(), ["a1"]);
    // Rotated past `a`, the next claim takes `b` although `a`'s rows are ten minutes older.
    let second = claim_after(h, &["a", "b"], 1, Some("a")).await;
    assert_eq!(second.iter().map(label).collect::<Vec<_>>(), ["b1"]);

    let rest = drain(h, &["a", "b"], 1).await;
    let order: Vec<String> = ["a1", "b1"]
        .into_iter()
        .map(str::to_owned)
        .chain(rest.into_iter().flatten())
        .collect();
    assert_eq!(order.len(), 31, "every row claimed once: {order:?}");
    let b = order.iter().position(|l| l == "b1").unwrap() + 1;
    assert_eq!(b, 2, "b's row runs 2nd of 31, not 31st: {order:?}");
    assert_eq!(order[2..], a[1..], "then a's backlog, by deadline");
}

/// The same case through `drain` from the start, with `b`'s row published while the
/// backlog is being claimed: it is taken by the next claim but one.
async fn a_row_falling_due_mid_backlog_waits_at_most_n_claims<H: Harness>(h: &H) {
    backlog(h, "a", &["a1", "a2", "a3", "a4", "a5", "a6"]).await;
    h.advance(secs(600)).await;
    let first = claim_after(h, &["a", "b"], 1, None).await;
    let second = claim_after(h, &["a", "b"], 1, Some("a")).await;
    assert_eq!(
        [&first, &second].map(|c| c.iter().map(label).collect::<Vec<_>>()),
        [["a1"], ["a2"]],
        "only a has due rows: it takes every claim"
    );
    publish(h, Message::new("b", b"b1")).await;
    let third = claim_after(h, &["a", "b"], 1, Some("a")).await;
    assert_eq!(third.iter().map(label).collect::<Vec<_>>(), ["b1"]);
    let fourth = claim_after(h, &["a", "b"], 1, Some("b")).await;
    assert_eq!(fourth.iter().map(label).collect::<Vec<_>>(), ["a3"]);
}

/// Three queues with backlogs of 4, 2 and 3 rows, `Q3`'s the oldest: the whole claim order
/// for claims of 1, 2 and 5 rows (more than the queues), each claim resuming after the
/// previous claim's last queue. Every queue with due rows is served within 3 claims.
async fn three_queues_one_row_a_claim<H: Harness>(h: &H) {
    let (m, o, t) = (["m1", "m2", "m3", "m4"], ["o1", "o2"], ["t1", "t2", "t3"]);
    // Q3's rows are the oldest, Q's the newest: the order below is the rotation's, not
    // the deadlines'.
    backlog(h, Q3, &t).await;
    backlog(h, Q2, &o).await;
    backlog(h, Q, &m).await;
    let queues = [Q, Q2, Q3];

    // One row a claim: the queues in turn, wrapping from Q3 to Q, skipping emptied ones.
    assert_eq!(
        drain(h, &queues, 1).await,
        labels(&[
            &["m1"],
            &["o1"],
            &["t1"],
            &["m2"],
            &["o2"],
            &["t2"],
            &["m3"],
            &["t3"],
            &["m4"],
        ])
    );
}

async fn three_queues_two_rows_a_claim<H: Harness>(h: &H) {
    backlog(h, Q3, &["t1", "t2", "t3"]).await;
    backlog(h, Q2, &["o1", "o2"]).await;
    backlog(h, Q, &["m1", "m2", "m3", "m4"]).await;
    // Each claim takes the next two queues with due rows after the last one served; when
    // fewer than two queues have rows left, a queue's next row fills the claim (round 2).
    assert_eq!(
        drain(h, &[Q, Q2, Q3], 2).await,
        labels(&[
            &["m1", "o1"],
            &["t1", "m2"],
            &["o2", "t2"],
            &["m3", "t3"],
            &["m4"],
        ])
    );
}

async fn three_queues_more_rows_a_claim_than_queues<H: Harness>(h: &H) {
    backlog(h, Q3, &["t1", "t2", "t3"]).await;
    backlog(h, Q2, &["o1", "o2"]).await;
    backlog(h, Q, &["m1", "m2", "m3", "m4"]).await;
    // Five rows: round 1 takes every queue's first row, round 2 starts again at Q and
    // ends on Q2; the next claim starts at Q3.
    assert_eq!(
        drain(h, &[Q, Q2, Q3], 5).await,
        labels(&[&["m1", "o1", "t1", "m2", "o2"], &["t2", "m3", "t3", "m4"]])
    );
}

/// Where a claim's rounds start, for every kind of `resume_after`: each queue of the list,
/// so the rotation wraps from the last back to the first; a name not in the list (before,
/// between and after its queues), which starts at the first queue named after it; and
/// none, which starts at the first queue by name. A queue left out by its limit keeps its
/// place in the order. `peek` and the claim agree.
async fn the_rotation_wraps_and_places_any_name<H: Harness>(h: &H) {
    publish(h, Message::new(Q3, b"t1")).await;
    h.advance(secs(1)).await;
    publish(h, Message::new(Q2, b"o1")).await;
    h.advance(secs(1)).await;
    publish(h, Message::new(Q, b"m1")).await;
    h.advance(secs(1)).await;
    // The queues as the caller lists them: their order is not the claim's.
    let queues = [Q3.to_owned(), Q.to_owned(), Q2.to_owned()];
    let peek = |after: Option<&'static str>, limits: Option<&'static [usize]>| {
        let queues = &queues;
        async move {
            let mut request = ClaimRequest::new(queues, 10, TTL);
            if let Some(a) = after {
                request = request.resume_after(a);
            }
            if let Some(l) = limits {
                request = request.queue_limits(l);
            }
            let got = h.store().peek(request).await.expect("peek");
            got.into_iter().map(|(_, q)| q).collect::<Vec<_>>()
        }
    };
    for (after, want) in [
        (None, [Q, Q2, Q3]),
        (Some(Q), [Q2, Q3, Q]),
        (Some(Q2), [Q3, Q, Q2]),
        (Some(Q3), [Q, Q2, Q3]),
        (Some(""), [Q, Q2, Q3]),
        (Some("a"), [Q, Q2, Q3]),
        (Some("q.n"), [Q2, Q3, Q]),
        (Some("q.main.x"), [Q2, Q3, Q]),
        (Some("q.zzz"), [Q, Q2, Q3]),
        (Some("z"), [Q, Q2, Q3]),
    ] {
        assert_eq!(peek(after, None).await, want, "{} after {after:?}", H::NAME);
    }
    // Q2 has no room (its limit is 0), yet the rotation past it still starts at Q3, and
    // the rotation past Q ends on Q3 rather than Q2.
    let limits: &[usize] = &[10, 10, 0];
    assert_eq!(peek(Some(Q2), Some(limits)).await, [Q3, Q]);
    assert_eq!(peek(Some(Q), Some(limits)).await, [Q3, Q]);

    // The claim takes what `peek` lists, in that order.
    let got = claim_after(h, &[Q3, Q, Q2], 2, Some("q.n")).await;
    assert_eq!(got.iter().map(label).collect::<Vec<_>>(), ["o1", "t1"]);
    let got = claim_after(h, &[Q3, Q, Q2], 2, Some(Q3)).await;
    assert_eq!(got.iter().map(label).collect::<Vec<_>>(), ["m1"]);
}

/// A queue that empties drops out of the rounds and the others close up; the claim that
/// resumes after it starts at the queue named next. When it has a due row again, it is
/// served within the next 3 claims.
async fn a_queue_that_empties_and_fills_again<H: Harness>(h: &H) {
    backlog(h, Q, &["m1", "m2", "m3", "m4", "m5"]).await;
    backlog(h, Q2, &["o1"]).await;
    backlog(h, Q3, &["t1", "t2", "t3", "t4", "t5"]).await;
    let queues = [Q, Q2, Q3];
    let mut order = Vec::new();
    let mut last: Option<String> = None;
    for _ in 0..4 {
        let got = claim_after(h, &queues, 1, last.as_deref()).await;
        last = got.last().map(|d| d.queue.clone());
        order.extend(got.iter().map(label));
    }
    assert_eq!(order, ["m1", "o1", "t1", "m2"]);
    // Q2 is empty: the claim after Q goes straight on to Q3.
    let got = claim_after(h, &queues, 1, Some(Q)).await;
    assert_eq!(got.iter().map(label).collect::<Vec<_>>(), ["t2"]);
    // A claim resuming after the empty queue itself starts at the next one.
    let got = claim_after(h, &queues, 1, Some(Q2)).await;
    assert_eq!(got.iter().map(label).collect::<Vec<_>>(), ["t3"]);
    // Q2 gets a due row again while the claimer is at Q3 (so Q is next): Q, then Q2.
    publish(h, Message::new(Q2, b"o2")).await;
    let got = claim_after(h, &queues, 1, Some(Q3)).await;
    assert_eq!(got.iter().map(label).collect::<Vec<_>>(), ["m3"]);
    let got = claim_after(h, &queues, 1, Some(Q)).await;
    assert_eq!(got.iter().map(label).collect::<Vec<_>>(), ["o2"]);
    assert_eq!(
        drain(h, &queues, 1).await,
        labels(&[&["m4"], &["t4"], &["m5"], &["t5"]]),
        "drain starts after nothing: at Q"
    );
}

/// The promise for any claim size: with `n` queues, a queue with a due row is claimed
/// within `n` claims, however much the others hold. Four queues whose backlogs differ in
/// size and age, claims of 1 to 5 rows (one set of queues per claim size, all in one
/// table); then, for each claim size, each queue's first claim and the gaps between the
/// claims that take from it while it still has rows.
async fn every_queue_is_served_within_n_claims_for_any_claim_size<H: Harness>(h: &H) {
    let sizes = [7usize, 1, 3, 5];
    let n = sizes.len();
    for limit in 1..=5usize {
        let queues: Vec<String> = (0..n).map(|i| format!("l{limit}.q{i}")).collect();
        // The last queues' rows are the oldest: without rotation their backlog would take
        // every claim of one row.
        for (i, q) in queues.iter().enumerate().rev() {
            for k in 0..sizes[i] {
                publish(h, Message::new(q, format!("{i}.{k}").as_bytes())).await;
                h.advance(secs(1)).await;
            }
        }
        let queues: Vec<&str> = queues.iter().map(String::as_str).collect();
        let claims = drain(h, &queues, limit).await;
        let total: usize = claims.iter().map(Vec::len).sum();
        assert_eq!(
            total,
            sizes.iter().sum::<usize>(),
            "{} limit {limit}",
            H::NAME
        );
        for (i, &size) in sizes.iter().enumerate() {
            let mine =
                |c: &Vec<String>| c.iter().filter(|l| l.starts_with(&format!("{i}."))).count();
            let served: Vec<usize> = claims
                .iter()
                .enumerate()
                .filter(|(_, c)| mine(c) > 0)
                .map(|(k, _)| k)
                .collect();
            let taken: usize = claims.iter().map(mine).sum();
            assert_eq!(taken, size);
            assert!(
                served[0] < n,
                "{} limit {limit}: queue {i} first served by claim {}: {claims:?}",
                H::NAME,
                served[0] + 1
            );
            assert!(
                served.windows(2).all(|w| w[1] - w[0] <= n),
                "{} limit {limit}: queue {i} waited more than {n} claims: {claims:?}",
                H::NAME
            );
            // Within a claim a queue's rows are by deadline.
            let rows: Vec<&String> = claims
                .iter()
                .flatten()
                .filter(|l| l.starts_with(&format!("{i}.")))
                .collect();
            let want: Vec<String> = (0..size).map(|k| format!("{i}.{k}")).collect();
            assert_eq!(rows, want.iter().collect::<Vec<_>>());
        }
    }
}

contract! {
    a_fresh_row_is_not_held_back_by_an_old_backlog_one_row_a_claim(dead_letter = false);
    a_row_falling_due_mid_backlog_waits_at_most_n_claims(dead_letter = false);
    three_queues_one_row_a_claim(dead_letter = false);
    three_queues_two_rows_a_claim(dead_letter = false);
    three_queues_more_rows_a_claim_than_queues(dead_letter = false);
    the_rotation_wraps_and_places_any_name(dead_letter = false);
    a_queue_that_empties_and_fills_again(dead_letter = false);
    every_queue_is_served_within_n_claims_for_any_claim_size(dead_letter = false);
}
