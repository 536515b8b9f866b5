// `cron` needs outbox's `cron` feature; this crate does not enable it.
#[outbox::timer(queue = "reports.daily", max_deliveries = 3, cron = "0 0 6 * * *", tz = "Europe/Berlin")]
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct DailyReport;

fn main() {}
