//! The example of the guide's "Testing" page (`docs/guide/testing.md`), verbatim
//! (`docs::readme` checks the page's block is this file's code): a user's test of a handler
//! on the in-memory store with virtual time.

use std::time::Duration;

use outbox::store::Completion;
use outbox::testing::MemoryStore;
use outbox::worker::Decision;
use outbox::{Context, Worker};

#[outbox::timer(queue = "presence.expiry", max_deliveries = 5)]
#[derive(serde::Serialize, serde::Deserialize)]
pub struct PresenceExpiry {
    pub user_id: i64,
}

async fn on_expiry(t: PresenceExpiry, _ctx: Context) -> Result<(), String> {
    println!("user {} expired", t.user_id); // your logic
    Ok(())
}

#[tokio::test]
async fn expiry_fires_a_minute_after_the_last_ping() -> Result<(), outbox::Error> {
    let store = MemoryStore::new();
    let worker = Worker::builder(store.clone())
        .timer::<PresenceExpiry>(on_expiry)
        .build()?;
    let user = PresenceExpiry { user_id: 7 };
    extend_presence_expiry(&store, "7", &user, Duration::from_secs(60)).await?;
    store.advance(Duration::from_secs(59));
    assert!(worker.run_due().await?.is_empty(), "not due yet");
    store.advance(Duration::from_secs(1)); // virtual time: nothing sleeps
    let ran = worker.run_due().await?;
    assert_eq!(ran.len(), 1);
    assert_eq!(ran[0].decision, Decision::Ack);
    assert_eq!(ran[0].completion, Completion::Deleted);
    Ok(())
}
