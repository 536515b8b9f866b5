#[outbox::timer(queue = "presence.expiry", max_deliveries = 5)]
#[derive(serde::Serialize, serde::Deserialize)]
enum Presence {
    Online,
    Offline,
}

fn main() {}
