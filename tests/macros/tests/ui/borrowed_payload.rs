// `Deserialize<'de>` for one lifetime is not `DeserializeOwned`: a stored payload must
// decode without borrowing from the row.
#[outbox::timer(queue = "presence.expiry", max_deliveries = 5)]
#[derive(serde::Serialize, serde::Deserialize)]
struct PresenceExpiry {
    user_id: i64,
    name: &'static str,
}

fn main() {}
