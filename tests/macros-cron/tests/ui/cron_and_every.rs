#[outbox::timer(queue = "reports", max_deliveries = 3, every = "1h", cron = "0 * * * *")]
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Report {}

fn main() {}
