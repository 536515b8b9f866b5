// A pool passed as `&mut pool` (the form a connection takes) is not a publisher: the error
// says which forms are, instead of listing unrelated implementors.
#[outbox::timer(queue = "presence.expiry", max_deliveries = 5)]
#[derive(serde::Serialize, serde::Deserialize)]
struct PresenceExpiry {
    user_id: i64,
}

async fn ping(mut pool: sqlx::PgPool) -> Result<(), outbox::Error> {
    let payload = PresenceExpiry { user_id: 1 };
    extend_presence_expiry(&mut pool, "1", &payload, std::time::Duration::from_secs(60)).await?;
    Ok(())
}

fn main() {
    let _ = ping;
}
