//! Distributed mode: how one claim is spread over the buckets that hold due rows.
//!
//! A claim on a single node is one statement that takes rows round robin across the queues
//! (each queue's earliest rows first, within its cap). On a Citus cluster a statement that
//! locks rows must stay on one shard, so a claim is one statement per bucket. To keep the
//! single node's fairness, the claim first reads, across the shards, how many rows each
//! queue has due in each bucket and when its earliest one came due ([`Work`], in that
//! order), then plans before it claims:
//!
//! 1. **Shares across queues**: the limit is dealt out one row per queue per turn, in the
//!    round's order (the one [`ClaimRequest::per_queue`](super::ClaimRequest) gives, which
//!    starts after the last queue served), each queue up to its cap and its due rows. This is
//!    exactly what the single-node statement takes when no row is locked by another claim.
//! 2. **Buckets within a queue**: a queue's share goes to its buckets in the order their
//!    earliest due rows came due, so the queue's earliest row is always in its share.
//! 3. **Statements**: one per bucket that got a share, the buckets in the order of their
//!    earliest due row, each with the queues that have a share there and that share as the
//!    queue's cap.
//!
//! A bucket whose rows another claim locked in the meantime gives fewer rows than planned:
//! the claim comes back short and the worker claims again at once, as on a single node.

/// Due rows of one queue in one bucket, as the read across the shards found them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Work {
    /// The bucket.
    pub bucket: i16,
    /// The queue.
    pub queue: String,
    /// How many rows are due (unleased or with an expired lease).
    pub rows: i64,
}

/// One claim statement: a bucket, and what it may take of each queue there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Visit {
    /// The bucket.
    pub bucket: i16,
    /// The queues with a share in this bucket, in the round's order.
    pub queues: Vec<String>,
    /// Each queue's share in this bucket (parallel to `queues`), all above zero.
    pub caps: Vec<i64>,
}

impl Visit {
    /// The statement's limit: the sum of the shares.
    pub(crate) fn limit(&self) -> i64 {
        self.caps.iter().sum()
    }
}

/// Plans a claim of at most `limit` rows over `queues` (in the round's order, `caps`
/// parallel) from `work`, which is ordered by the earliest due row of each entry (ties by
/// bucket). See the module docs.
pub(crate) fn plan(queues: &[String], caps: &[i64], limit: usize, work: &[Work]) -> Vec<Visit> {
    let due: Vec<i64> = queues
        .iter()
        .map(|q| work.iter().filter(|w| &w.queue == q).map(|w| w.rows).sum())
        .collect();
    // 1. Shares: one row per queue per turn, in the round's order.
    let most: Vec<i64> = caps.iter().zip(&due).map(|(c, d)| (*c).min(*d)).collect();
    let mut share = vec![0i64; queues.len()];
    let mut left = i64::try_from(limit).unwrap_or(i64::MAX);
    // Whole turns at once while every queue still wanting rows can take one more: the
    // loop below then runs at most once per queue, not once per row.
    loop {
        let wanting = share.iter().zip(&most).filter(|(s, m)| s < m).count() as i64;
        if wanting == 0 || left == 0 {
            break;
        }
        let step = share
            .iter()
            .zip(&most)
            .filter(|(s, m)| s < m)
            .map(|(s, m)| m - s)
            .min()
            .unwrap_or(0)
            .min(left / wanting);
        if step == 0 {
            // Fewer rows left than queues wanting one: the first in the round get them.
            for (s, m) in share.iter_mut().zip(&most) {
                if left > 0 && *s < *m {
                    *s += 1;
                    left -= 1;
                }
            }
            break;
        }
        for (s, m) in share.iter_mut().zip(&most) {
            if *s < *m {
                *s += step;
                left -= step;
            }
        }
    }
    // 2. Each queue's share over its buckets, earliest first.
    let mut visits: Vec<Visit> = Vec::new();
    for w in work {
        let Some(i) = queues.iter().position(|q| q == &w.queue) else {
            continue;
        };
        let take = share[i].min(w.rows);
        if take <= 0 {
            continue;
        }
        share[i] -= take;
        // 3. One statement per bucket, in the order of the bucket's earliest due row.
        let visit = match visits.iter_mut().position(|v| v.bucket == w.bucket) {
            Some(v) => &mut visits[v],
            None => {
                visits.push(Visit {
                    bucket: w.bucket,
                    queues: Vec::new(),
                    caps: Vec::new(),
                });
                visits.last_mut().expect("just pushed")
            }
        };
        match visit.queues.iter().position(|q| q == &w.queue) {
            Some(j) => visit.caps[j] += take,
            None => {
                visit.queues.push(w.queue.clone());
                visit.caps.push(take);
            }
        }
    }
    // The statement takes a queue's place in the round from its position in the array.
    for v in &mut visits {
        let mut pairs: Vec<(String, i64)> = v.queues.drain(..).zip(v.caps.drain(..)).collect();
        pairs.sort_by_key(|(q, _)| queues.iter().position(|x| x == q));
        (v.queues, v.caps) = pairs.into_iter().unzip();
    }
    visits
}

#[cfg(test)]
mod tests {
    use super::*;

    fn work(bucket: i16, queue: &str, rows: i64) -> Work {
        Work {
            bucket,
            queue: queue.to_owned(),
            rows,
        }
    }

    fn names(qs: &[&str]) -> Vec<String> {
        qs.iter().map(|q| (*q).to_owned()).collect()
    }

    fn visit(bucket: i16, shares: &[(&str, i64)]) -> Visit {
        Visit {
            bucket,
            queues: shares.iter().map(|(q, _)| (*q).to_owned()).collect(),
            caps: shares.iter().map(|(_, c)| *c).collect(),
        }
    }

    #[test]
    fn a_small_queue_gets_its_row_beside_a_big_queue_spread_over_every_bucket() {
        // `big` has 100 rows in each of 16 buckets, all due earlier than `small`'s one row.
        let mut w: Vec<Work> = (0..16).map(|b| work(b, "big", 100)).collect();
        w.push(work(9, "small", 1));
        let got = plan(&names(&["big", "small"]), &[10, 10], 10, &w);
        assert_eq!(got, [visit(0, &[("big", 9)]), visit(9, &[("small", 1)])]);
    }

    #[test]
    fn shares_are_dealt_one_per_queue_per_turn_in_the_rounds_order() {
        let w = [work(0, "a", 5), work(1, "b", 1), work(2, "c", 5)];
        let qs = names(&["b", "c", "a"]);
        // 7 rows: b takes its one, then c and a alternate from c: c 3, a 3.
        let got = plan(&qs, &[9, 9, 9], 7, &w);
        assert_eq!(
            got,
            [
                visit(0, &[("a", 3)]),
                visit(1, &[("b", 1)]),
                visit(2, &[("c", 3)])
            ]
        );
        // Fewer rows than queues: the first in the round.
        let got = plan(&qs, &[9, 9, 9], 2, &w);
        assert_eq!(got, [visit(1, &[("b", 1)]), visit(2, &[("c", 1)])]);
    }

    #[test]
    fn a_queue_takes_no_more_than_its_cap_and_the_rest_goes_to_the_others() {
        let w = [work(0, "a", 50), work(0, "b", 50)];
        let got = plan(&names(&["a", "b"]), &[2, 100], 10, &w);
        assert_eq!(got, [visit(0, &[("a", 2), ("b", 8)])]);
    }

    #[test]
    fn a_queues_share_goes_to_its_earliest_buckets_first() {
        // Ordered by the earliest due row: bucket 3 before bucket 1.
        let w = [work(3, "a", 2), work(1, "a", 10), work(3, "b", 1)];
        let got = plan(&names(&["a", "b"]), &[10, 10], 5, &w);
        assert_eq!(
            got,
            [visit(3, &[("a", 2), ("b", 1)]), visit(1, &[("a", 2)])]
        );
    }

    #[test]
    fn nothing_due_or_nothing_asked_plans_nothing() {
        assert!(plan(&names(&["a"]), &[5], 5, &[]).is_empty());
        assert!(plan(&names(&["a"]), &[5], 0, &[work(0, "a", 3)]).is_empty());
        assert!(plan(&names(&["a"]), &[5], 5, &[work(0, "z", 3)]).is_empty());
    }

    #[test]
    fn the_plan_never_exceeds_the_limit_a_cap_or_the_rows_due() {
        // Every small combination.
        let qs = names(&["a", "b", "c"]);
        for limit in 0..12usize {
            for caps in [[0, 1, 2], [3, 3, 3], [1, 0, 9], [9, 9, 9]] {
                for rows in [[0, 1, 5], [2, 2, 2], [7, 0, 1]] {
                    let w: Vec<Work> = rows
                        .iter()
                        .enumerate()
                        .flat_map(|(i, r)| {
                            [work(i as i16, &qs[i], r / 2), work(5, &qs[i], r - r / 2)]
                        })
                        .filter(|w| w.rows > 0)
                        .collect();
                    let got = plan(&qs, &caps, limit, &w);
                    let total: i64 = got.iter().map(Visit::limit).sum();
                    let most: i64 = caps.iter().zip(rows).map(|(c, r)| (*c).min(r)).sum();
                    assert_eq!(total, most.min(limit as i64), "{limit} {caps:?} {rows:?}");
                    for (i, q) in qs.iter().enumerate() {
                        let of_q: i64 = got
                            .iter()
                            .flat_map(|v| v.queues.iter().zip(&v.caps))
                            .filter(|(x, _)| *x == q)
                            .map(|(_, c)| c)
                            .sum();
                        assert!(of_q <= caps[i].min(rows[i]), "{q}: {of_q}");
                    }
                    assert!(got.iter().all(|v| v.caps.iter().all(|c| *c > 0)));
                }
            }
        }
    }
}
