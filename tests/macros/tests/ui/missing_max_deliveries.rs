#[outbox::timer(queue = "presence.expiry")]
#[derive(serde::Serialize, serde::Deserialize)]
struct PresenceExpiry {
    user_id: i64,
}

fn main() {}
