#[outbox::timer(queue = "reports", max_deliveries = 3, cron = "0 6 * * *", tz = "Europe/Berlln")]
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Report {}

fn main() {}
