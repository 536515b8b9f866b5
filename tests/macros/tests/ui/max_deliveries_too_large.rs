// u32::MAX + 1
#[outbox::timer(queue = "presence.expiry", max_deliveries = 4294967296)]
#[derive(serde::Serialize, serde::Deserialize)]
struct PresenceExpiry {
    user_id: i64,
}

fn main() {}
