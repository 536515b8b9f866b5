// "1M" is a month to humantime (30.44 days), one letter from "1m", a minute.
#[outbox::timer(queue = "maintenance", max_deliveries = 3, every = "1M")]
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Cleanup;

#[outbox::timer(queue = "reports", max_deliveries = 3, every = "1year")]
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct Yearly;

fn main() {}
