// Each run of a declared schedule gets the payload's `Default`.
#[outbox::timer(queue = "maintenance", max_deliveries = 3, every = "5m")]
#[derive(serde::Serialize, serde::Deserialize)]
struct Cleanup {
    older_than_days: u32,
}

fn main() {}
