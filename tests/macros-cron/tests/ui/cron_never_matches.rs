#[outbox::timer(queue = "reports", max_deliveries = 3, cron = "0 0 30 2 *")]
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Report {}

fn main() {}
