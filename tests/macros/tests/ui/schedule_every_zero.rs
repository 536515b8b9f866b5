#[outbox::timer(queue = "maintenance", max_deliveries = 3, every = "0s")]
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Cleanup;

fn main() {}
