#[outbox::timer(queue = "maintenance", max_deliveries = 3, every = 300)]
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Cleanup;

fn main() {}
