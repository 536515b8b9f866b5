//! Through a real PgBouncer 1.18 in transaction mode (`outbox_tests::pgbouncer`, configured
//! by the block of docs/guide/deployment.md, "PgBouncer"), SPEC §13: what sqlx's protocol
//! meets there (`protocol`), then the library with `OutboxBuilder::transaction_pooler(true)`.

mod protocol;

use std::time::Duration;

pub(crate) use outbox_tests::pgbouncer::PgBouncer as Bouncer;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

/// A pool of at most `max` client connections to the pooler.
pub(crate) async fn pooled(bouncer: &Bouncer, max: u32) -> PgPool {
    let opts: PgConnectOptions = bouncer.url().parse().expect("the pooler's URL");
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(opts.disable_statement_logging())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "connect through pgbouncer: {e}; its log:\n{}",
                bouncer.log()
            )
        })
}
