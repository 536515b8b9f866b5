#[outbox::timer(queue = "presence.expiry", max_deliveries = 5)]
union Presence {
    user_id: i64,
    flags: u64,
}

fn main() {}
