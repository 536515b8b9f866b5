// A connection passed by value would be consumed by the call: not a publisher either.
#[outbox::timer(queue = "presence.expiry", max_deliveries = 5)]
#[derive(serde::Serialize, serde::Deserialize)]
struct PresenceExpiry {
    user_id: i64,
}

async fn logout(conn: sqlx::PgConnection) -> Result<(), outbox::Error> {
    cancel_presence_expiry(conn, "1").await?;
    Ok(())
}

fn main() {
    let _ = logout;
}
