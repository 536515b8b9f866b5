//! A streaming standby (issue 26): a throwaway primary and its `pg_basebackup -R` replica,
//! started by each test (`outbox_bench::cluster`, `outbox_bench::replica`) and removed
//! when it ends.
//!
//! - `writes`: publishing, cancelling, `run_due` and `migrate` on a standby fail with
//!   `Error::ReadOnly` (SQLSTATE 25006, or `pg_is_in_recovery()` for `migrate`);
//! - `worker`: a started worker on a standby backs off (no hot loop), counts
//!   `outbox_claim_errors_total{error="ReadOnly"}`, keeps retrying LISTEN, and runs the rows
//!   once the standby is promoted, within 3 × the 5 s back-off cap; a periodic schedule
//!   registers then too;
//! - `failover`: the primary stops, the standby is promoted and takes over its address; a
//!   worker reconnects, re-LISTENs (a notification wakes it though its poll is 60 s), and
//!   every row committed before the switch runs exactly once.

mod failover;
mod worker;
mod writes;

use std::time::Duration;

use outbox::Outbox;
use outbox_bench::cluster::Cluster;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

/// A primary with the outbox migrated, and its standby caught up.
pub(super) struct Pair {
    pub primary: Cluster,
    pub standby: Cluster,
    pub outbox: Outbox,
}

impl Pair {
    pub async fn start() -> Pair {
        let primary = Cluster::start(None, &[])
            .await
            .expect("a throwaway primary starts");
        let outbox = Outbox::builder()
            .table(outbox_tests::unique_table("sb"))
            .dead_letter(true)
            .build()
            .unwrap();
        outbox
            .migrate(&pool_at(primary.port()).await)
            .await
            .expect("migrate on the primary");
        let standby = primary.standby().await.expect("the standby starts");
        assert!(standby.in_recovery().await.unwrap(), "a hot standby");
        let pair = Pair {
            primary,
            standby,
            outbox,
        };
        pair.replayed().await;
        pair
    }

    /// Waits until the standby has replayed what the primary wrote so far.
    pub async fn replayed(&self) {
        self.primary
            .wait_replayed(&self.standby, Duration::from_secs(30))
            .await
            .expect("the standby replays");
    }
}

/// A pool on `127.0.0.1:<port>`, database `postgres`; acquiring gives up after 3 s so a
/// stopped server shows as an error quickly.
pub(super) async fn pool_at(port: u16) -> PgPool {
    PgPoolOptions::new()
        .max_connections(6)
        .acquire_timeout(Duration::from_secs(3))
        .connect_lazy_with(options_at(port))
}

pub(super) fn options_at(port: u16) -> PgConnectOptions {
    PgConnectOptions::new()
        .host("127.0.0.1")
        .port(port)
        .username("postgres")
        .database("postgres")
}
