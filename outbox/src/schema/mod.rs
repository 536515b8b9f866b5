//! The schema: migrations, the steps they run, validating a database against this version,
//! and the upgrade guide ([`upgrading`]).
//!
//! [`migrate`](crate::migrate) (at the crate root) creates or upgrades the tables of the
//! default [`Outbox`]; [`Outbox::migrate`](crate::Outbox::migrate) and
//! [`Outbox::migrate_with`](crate::Outbox::migrate_with) do it for other names and with
//! [`MigrateOptions`]. [`migration_steps`] renders the same steps as SQL files for a
//! migration tool of your own.

use sqlx::PgPool;

use crate::error::Result;
use crate::outbox::Outbox;

// The files below work on rendered statements and sit beneath the `Outbox` handle, which
// calls them; only this file takes a handle (the two functions over the default one), so
// nothing the handle or `error.rs` imports may be defined here.
pub(crate) mod migrate;
pub(crate) mod problem;
pub(crate) mod server;
pub(crate) mod shape;
pub(crate) mod validate;

pub use self::migrate::{AppliedMigration, MigrateOptions, MigrationStep};
pub use self::problem::{LockHolder, SchemaProblem, UPGRADE_GUIDE};
pub use self::server::SUPPORTED_POSTGRES;
pub use self::shape::{DEFAULT_TABLE, MAX_NAME_BYTES};

/// The migration steps for `outbox`'s names; see [`Outbox::migration_steps`].
pub fn migration_steps(outbox: &Outbox) -> Vec<MigrationStep> {
    outbox.migration_steps()
}

/// Validates the default outbox ([`Outbox::default`]); see [`Outbox::validate_schema`].
///
/// # Errors
/// As [`Outbox::validate_schema`].
pub async fn validate_schema(pool: &PgPool) -> Result<()> {
    Outbox::default().validate_schema(pool).await
}

#[doc = include_str!("../../docs/upgrading.md")]
pub mod upgrading {}
