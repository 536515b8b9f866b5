#[outbox::timer(queue = "presence.expiry", max_deliveries = 5, queue = "presence.expiry.v2")]
#[derive(serde::Serialize, serde::Deserialize)]
struct PresenceExpiry {
    user_id: i64,
}

fn main() {}
