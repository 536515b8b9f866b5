#[outbox::timer(queue = "presence.expiry", max_deliveries = 5)]
fn presence_expiry() {}

fn main() {}
