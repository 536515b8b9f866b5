#[outbox::timer(queue = "maintenance", max_deliveries = 3, every = "5 minutes please")]
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Cleanup;

fn main() {}
