// Every problem is reported in one compile, each at its own token.
#[outbox::timer(queue = "", max_deliveries = 0, retries = 3, queue = "again")]
enum Presence {
    Online,
}

fn main() {}
