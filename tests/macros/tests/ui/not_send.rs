use std::rc::Rc;

#[outbox::timer(queue = "presence.expiry", max_deliveries = 5)]
#[derive(serde::Serialize, serde::Deserialize)]
struct PresenceExpiry {
    user_id: Rc<i64>,
}

fn main() {}
