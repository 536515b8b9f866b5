#[outbox::timer(queue = "maintenance", max_deliveries = 3, tz = "Europe/Berlin")]
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Cleanup;

fn main() {}
