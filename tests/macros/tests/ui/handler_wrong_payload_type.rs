use std::time::Duration;

#[outbox::timer(queue = "presence.expiry", max_deliveries = 5)]
#[derive(serde::Serialize, serde::Deserialize)]
pub struct PresenceExpiry {
    pub user_id: i64,
}

#[outbox::timer(queue = "operator.timeout", max_deliveries = 3)]
#[derive(serde::Serialize, serde::Deserialize)]
pub struct OperatorTimeout {
    pub conversation: String,
}

async fn on_timeout(_t: OperatorTimeout, _ctx: outbox::Context) -> Result<(), String> {
    Ok(())
}

fn wire(store: outbox::PgStore) {
    let _ = outbox::Worker::builder(store)
        .timer::<PresenceExpiry>(on_timeout)
        .idle_poll(Duration::from_secs(1));
}

fn main() {}
