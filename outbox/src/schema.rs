//! The schema: migrations, the steps they run, validating a database against this version,
//! and the upgrade guide ([`upgrading`]).
//!
//! [`migrate`](crate::migrate) (at the crate root) creates or upgrades the tables of the
//! default [`Outbox`](crate::Outbox); [`Outbox::migrate`](crate::Outbox::migrate) and
//! [`Outbox::migrate_with`](crate::Outbox::migrate_with) do it for other names and with
//! [`MigrateOptions`]. [`migration_steps`] renders the same steps as SQL files for a
//! migration tool of your own.

pub use crate::error::{LockHolder, SchemaProblem, UPGRADE_GUIDE};
pub use crate::migrate::{AppliedMigration, MigrateOptions, MigrationStep};
pub use crate::names::DEFAULT_TABLE;
pub use crate::outbox::{migration_steps, validate_schema};
pub use crate::publish::MAX_NAME_BYTES;

#[doc = include_str!("../docs/upgrading.md")]
pub mod upgrading {}
