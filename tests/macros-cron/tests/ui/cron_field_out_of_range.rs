#[outbox::timer(queue = "reports", max_deliveries = 3, cron = "0 61 * * *")]
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Report {}

fn main() {}
