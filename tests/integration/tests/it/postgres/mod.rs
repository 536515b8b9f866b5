//! What only a real database shows, on Postgres' own clock: the caller's transaction,
//! row locks and races between sessions, plans, size limits, grants, migrations and the
//! schema, a rolling deploy, several worker processes. The store-level rules themselves are
//! contract scenarios (`contract`), run on both stores.

mod admin;
mod claim;
mod deploy;
mod dlq;
mod grants;
mod limits;
mod locks;
mod migrate;
mod plans;
mod processes;
mod publish;
mod rearm;
mod schema;
mod slack;
mod stats;
mod version;
