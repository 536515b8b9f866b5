//! Distributed mode (Citus): which logical bucket a row lives in. The queue and dead-letter
//! tables are distributed by a `bucket smallint` column in `0..buckets`; every statement
//! that reads or writes rows of one bucket names it (`bucket = $n`), so Citus routes it to
//! the one shard that holds the bucket.
//!
//! - A keyed timer's bucket is a function of its key alone ([`Buckets::of_key`]), so one
//!   live row per `(queue, timer_id)` holds across the cluster: the unique index
//!   `(bucket, queue, timer_id)` sits on one shard per key.
//! - A row id carries its bucket: ids are `nextval(sequence) * buckets + bucket`, so any
//!   statement addressed by id (a completion, a renewal, an admin action) finds the bucket
//!   with [`Buckets::of_id`], without the lease or the caller carrying it.
//!
//! A leaf: no other module of the crate is used here.

/// The bucket layout of a distributed outbox: how many buckets there are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Buckets {
    count: u16,
}

/// The most buckets a distributed outbox may have. A worker node's sequence values start
/// at its group id << 48 (Citus), so ids up to `(group << 48) * 256 + 255` stay below
/// 2⁶³ for clusters of up to 127 node groups.
pub(crate) const MAX_BUCKETS: u16 = 256;

impl Buckets {
    /// `count` in `1..=MAX_BUCKETS`; `None` otherwise.
    pub(crate) fn new(count: u16) -> Option<Buckets> {
        (1..=MAX_BUCKETS)
            .contains(&count)
            .then_some(Buckets { count })
    }

    pub(crate) fn count(self) -> u16 {
        self.count
    }

    /// The bucket of a key: 32-bit FNV-1a of its UTF-8 bytes, modulo the bucket count.
    pub(crate) fn of_key(self, key: &str) -> i16 {
        let mut h: u32 = 0x811c_9dc5;
        for b in key.as_bytes() {
            h ^= u32::from(*b);
            h = h.wrapping_mul(0x0100_0193);
        }
        // < count <= 256: fits.
        (h % u32::from(self.count)) as i16
    }

    /// The bucket of a row id (`nextval * count + bucket`).
    pub(crate) fn of_id(self, id: i64) -> i16 {
        // rem_euclid of a positive modulus <= 256: fits.
        id.rem_euclid(i64::from(self.count)) as i16
    }

    /// Splits `items` into runs of one bucket each, in order of first appearance, keeping
    /// the order within each run.
    pub(crate) fn group<T: Clone>(self, items: &[T], id: impl Fn(&T) -> i64) -> Vec<(i16, Vec<T>)> {
        let mut out: Vec<(i16, Vec<T>)> = Vec::new();
        for item in items {
            let b = self.of_id(id(item));
            match out.iter_mut().find(|(k, _)| *k == b) {
                Some((_, v)) => v.push(item.clone()),
                None => out.push((b, vec![item.clone()])),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_always_lands_in_the_same_bucket_within_range() {
        let b = Buckets::new(32).unwrap();
        for key in ["", "a", "user-1", "ünïcode", "1546881080000"] {
            let x = b.of_key(key);
            assert!((0..32).contains(&x));
            assert_eq!(x, b.of_key(key));
        }
        // FNV-1a 32 of "a" is 0xe40c292c; mod 32 = 12.
        assert_eq!(b.of_key("a"), 12);
    }

    #[test]
    fn keys_spread_over_the_buckets() {
        let b = Buckets::new(16).unwrap();
        let mut seen = [0u32; 16];
        for i in 0..16_000 {
            seen[b.of_key(&i.to_string()) as usize] += 1;
        }
        assert!(seen.iter().all(|n| (700..1300).contains(n)), "{seen:?}");
    }

    #[test]
    fn an_id_carries_its_bucket() {
        let b = Buckets::new(32).unwrap();
        assert_eq!(b.of_id(7 * 32 + 5), 5);
        assert_eq!(b.of_id(0), 0);
        let groups = b.group(&[33_i64, 1, 66, 65, 2], |x| *x);
        assert_eq!(groups, vec![(1, vec![33, 1, 65]), (2, vec![66, 2])]);
    }

    #[test]
    fn the_count_is_bounded() {
        assert!(Buckets::new(0).is_none());
        assert!(Buckets::new(MAX_BUCKETS + 1).is_none());
        assert_eq!(Buckets::new(MAX_BUCKETS).unwrap().count(), MAX_BUCKETS);
    }
}
