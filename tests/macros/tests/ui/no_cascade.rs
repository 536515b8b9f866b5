// A mistake in the attribute is one error: the functions and the `Timer` impl still
// exist, so code using them does not fail a second time.
use outbox::Timer;

#[outbox::timer(queue = "presence expiry", max_deliveries = 5)]
#[derive(serde::Serialize, serde::Deserialize)]
struct PresenceExpiry {
    user_id: i64,
}

async fn ping(conn: &mut sqlx::PgConnection) -> Result<(), outbox::Error> {
    let payload = PresenceExpiry { user_id: 1 };
    publish_presence_expiry(&mut *conn, "1", &payload, std::time::Duration::from_secs(60)).await?;
    extend_presence_expiry(&mut *conn, "1", &payload, std::time::Duration::from_secs(60)).await?;
    cancel_presence_expiry(conn, "1").await?;
    let _queue = PresenceExpiry::QUEUE;
    Ok(())
}

fn main() {
    let _ = ping;
}
