#[outbox::timer(queue = "maintenance", max_deliveries = 3, every = "5m", cron = "*/5 * * * *")]
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Cleanup;

fn main() {}
