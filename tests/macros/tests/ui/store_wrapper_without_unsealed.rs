// `Store` is sealed for 0.x: a type outside the crate implements it only as a test's wrapper
// of a store, with `outbox::testing::Unsealed` (feature `testing`) beside it. This wrapper
// forgot the marker.
use std::time::Duration;

use outbox::store::{
    ClaimRequest, Completion, Delivery, Failure, Lease, NextWakeup, Release, Released, Renewal,
    Store, Wakeup,
};
use outbox::testing::MemoryStore;

#[derive(Clone)]
struct Wrapper(MemoryStore);

impl Store for Wrapper {
    async fn claim(&self, r: ClaimRequest<'_>) -> outbox::Result<Vec<Delivery>> {
        self.0.claim(r).await
    }
    async fn ack(&self, l: Lease) -> outbox::Result<Completion> {
        self.0.ack(l).await
    }
    async fn ack_batch(&self, l: &[Lease]) -> outbox::Result<Vec<Completion>> {
        self.0.ack_batch(l).await
    }
    async fn retry(&self, l: Lease, d: Duration) -> outbox::Result<Completion> {
        self.0.retry(l, d).await
    }
    async fn fail(&self, l: Lease, f: Failure<'_>) -> outbox::Result<Completion> {
        self.0.fail(l, f).await
    }
    async fn renew(&self, l: &[Lease]) -> outbox::Result<Vec<Renewal>> {
        self.0.renew(l).await
    }
    async fn release(&self, r: &[Release]) -> outbox::Result<Vec<Released>> {
        self.0.release(r).await
    }
    async fn fail_unclaimed(
        &self,
        id: i64,
        ttl: Duration,
        f: Failure<'_>,
    ) -> outbox::Result<Completion> {
        self.0.fail_unclaimed(id, ttl, f).await
    }
    async fn next_wakeup(&self, r: ClaimRequest<'_>) -> outbox::Result<NextWakeup> {
        self.0.next_wakeup(r).await
    }
    async fn peek(&self, r: ClaimRequest<'_>) -> outbox::Result<Vec<(i64, String)>> {
        self.0.peek(r).await
    }
    async fn wakeups(&self) -> outbox::Result<Option<tokio::sync::mpsc::Receiver<Wakeup>>> {
        self.0.wakeups().await
    }
    async fn now(&self) -> outbox::Result<chrono::DateTime<chrono::Utc>> {
        self.0.now().await
    }
    fn dead_letter_enabled(&self) -> bool {
        self.0.dead_letter_enabled()
    }
}

fn main() {}
