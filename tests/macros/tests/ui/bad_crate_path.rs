#[outbox::timer(queue = "presence.expiry", max_deliveries = 5, crate = "not a path")]
#[derive(serde::Serialize, serde::Deserialize)]
struct PresenceExpiry {
    user_id: i64,
}

fn main() {}
