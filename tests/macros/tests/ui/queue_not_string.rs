#[outbox::timer(queue = presence_expiry, max_deliveries = 5)]
#[derive(serde::Serialize, serde::Deserialize)]
struct PresenceExpiry {
    user_id: i64,
}

fn main() {}
