// `- 1` (spaced) is a unary minus rather than a negative literal; also rejected.
#[outbox::timer(queue = "presence.expiry", max_deliveries = - 1)]
#[derive(serde::Serialize, serde::Deserialize)]
struct PresenceExpiry {
    user_id: i64,
}

fn main() {}
