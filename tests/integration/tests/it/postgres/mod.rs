//! What only a real database shows, on Postgres' own clock: the caller's transaction,
//! row locks and races between sessions, plans, size limits, grants, migrations and the
//! schema, a rolling deploy, several worker processes, a streaming standby and failover
//! (`standby/`, on throwaway clusters), a managed server's session limits (`managed`).
//! The store-level rules themselves are contract scenarios (`contract`), run on both
//! stores.

mod admin;
mod citus;
mod claim;
mod deploy;
mod dlq;
mod grants;
mod limits;
mod locks;
mod managed;
mod migrate;
mod pgbouncer;
mod plans;
mod processes;
mod publish;
mod rearm;
mod schema;
mod slack;
mod standby;
mod stats;
mod version;
