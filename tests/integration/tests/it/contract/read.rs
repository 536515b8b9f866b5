//! Reading live rows without leasing them (`pending`).

use super::*;

async fn pending_reads_live_rows_by_deadline_with_a_limit<H: Harness>(h: &H) {
    publish(h, plain(b"a", 30)).await; // 1
    publish(h, plain(b"b", 0)).await; // 2
    publish(h, plain(b"c", 10)).await; // 3
    publish(h, Message::new(Q2, b"d")).await; // 4
    let d = claim_one(h).await;
    assert_eq!(d.lease.id, 2);
    let all = rows(h, Q).await;
    assert_eq!(
        all.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![2, 3, 1],
        "leased rows included"
    );
    let two = h.pending(Q, 2).await.unwrap();
    assert_eq!(two, all[..2].to_vec());
    assert!(h.pending(Q, 0).await.unwrap().is_empty());
    assert!(h.pending("nobody", 10).await.unwrap().is_empty());
    assert_eq!(invalid_field(h.pending("", 10).await.unwrap_err()), "queue");
    assert_eq!(
        invalid_field(h.dead_letters("", 10).await.unwrap_err()),
        "queue"
    );
}

contract! {
    pending_reads_live_rows_by_deadline_with_a_limit(dead_letter = true);
}
