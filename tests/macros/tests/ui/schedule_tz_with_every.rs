#[outbox::timer(queue = "maintenance", max_deliveries = 3, every = "1h", tz = "Europe/Berlin")]
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Cleanup;

fn main() {}
