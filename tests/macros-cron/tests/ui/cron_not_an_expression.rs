#[outbox::timer(queue = "reports", max_deliveries = 3, cron = "every morning")]
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Report {}

fn main() {}
