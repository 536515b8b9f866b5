//! Test hooks: what the project's own tests (and the benchmark harness) need beyond the
//! public API, built only with the `testing` feature and hidden from the docs. Not public
//! API: they may change in any release.

use sqlx::{PgConnection, PgPool};

use crate::error::Result;
use crate::outbox::Outbox;
use crate::schema::migrate::{self, MigrateOptions};
use crate::store::postgres::PgStore;
use crate::store::{ClaimRequest, Delivery};

impl Outbox {
    /// Every statement the runtime executes for this outbox's names, as `(name, text)`:
    /// the plan tests (`EXPLAIN`) read them.
    #[doc(hidden)]
    pub fn statements(&self) -> Vec<(&'static str, String)> {
        self.sql()
            .all()
            .into_iter()
            .map(|(name, sql)| (name, sql.to_owned()))
            .collect()
    }

    /// The claim of a relay ordered by the header `header`
    /// ([`Relay::ordered_by_header`](crate::relay::Relay::ordered_by_header)), rendered per
    /// relay and so not among [`Outbox::statements`]: `$1` queues, `$2` limit, `$3` lease
    /// TTL, `$4` ids never to claim, `$5` the new token.
    #[doc(hidden)]
    pub fn ordered_claim_statement(&self, header: &str) -> String {
        crate::sql::claim::ordered_claim(self.names(), header)
            .as_str()
            .to_owned()
    }

    /// The version check of `migrate()` and `validate_schema` against another range of
    /// major versions: the tests refuse the server they run on with it (no server outside
    /// the supported range is at hand). Returns the server's major version.
    #[doc(hidden)]
    pub async fn require_postgres_within(
        &self,
        pool: &PgPool,
        supported: (u32, u32),
    ) -> Result<u32> {
        crate::schema::server::require(pool, supported).await
    }

    /// Applies only the base shape (the first migration step: the queue table without the
    /// rearm columns, the rearm CHECK and the cancel mark, plus the dead-letter table), as a
    /// deployment that predates rearm has it: the upgrade tests start from it.
    #[doc(hidden)]
    pub async fn migrate_base_only(&self, pool: &PgPool) -> Result<()> {
        let options = MigrateOptions::default();
        migrate::run(&self.sql().ddl, self.names(), true, pool, 1, options).await
    }
}

impl PgStore {
    /// [`Store::claim`](crate::store::Store::claim) on `conn`: inside a transaction the
    /// claimed rows stay locked until it ends, which is how the race tests hold a claim
    /// open while another session acts on its rows.
    #[doc(hidden)]
    pub async fn claim_on(
        &self,
        conn: &mut PgConnection,
        request: ClaimRequest<'_>,
    ) -> Result<Vec<Delivery>> {
        self.claim_with(conn, request).await
    }
}
