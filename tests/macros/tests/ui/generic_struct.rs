#[outbox::timer(queue = "presence.expiry", max_deliveries = 5)]
#[derive(serde::Serialize, serde::Deserialize)]
struct PresenceExpiry<T> {
    user_id: T,
}

fn main() {}
