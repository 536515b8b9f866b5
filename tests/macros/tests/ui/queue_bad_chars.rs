#[outbox::timer(queue = "presence expiry/v2", max_deliveries = 5)]
#[derive(serde::Serialize, serde::Deserialize)]
struct PresenceExpiry {
    user_id: i64,
}

fn main() {}
