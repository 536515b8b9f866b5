#[outbox::timer(queue = "reports", max_deliveries = 3, cron = 5)]
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Report {}

fn main() {}
