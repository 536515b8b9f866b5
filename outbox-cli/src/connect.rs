//! Connecting, and turning what goes wrong into a sentence that says what to do.

use std::fmt;
use std::time::Duration;

use outbox::Error;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgPool};

/// A failure the command reports: one message that says what happened and what to do.
#[derive(Debug)]
pub struct Failure(pub String);

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure(explain(&e))
    }
}

impl From<sqlx::Error> for Failure {
    fn from(e: sqlx::Error) -> Self {
        Failure::from(Error::from(e))
    }
}

/// The library's error, with the instruction an operator at a shell needs: the command to
/// run rather than the function to call.
fn explain(e: &Error) -> String {
    match e {
        Error::NotMigrated { detail } => format!(
            "the outbox tables do not exist ({detail}): run `outbox migrate` with the same \
             --schema/--table, or check that --schema/--table name your application's tables"
        ),
        Error::UpgradeRequired { detail } => format!(
            "the outbox schema predates this version ({detail}): run `outbox migrate` with \
             the same --schema/--table ({})",
            outbox::schema::UPGRADE_GUIDE
        ),
        Error::SchemaNotFound { detail } => format!(
            "{detail}: create the schema first (CREATE SCHEMA …), then run `outbox migrate`"
        ),
        other => other.to_string(),
    }
}

/// The URL with its password replaced, for messages.
pub fn redact(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_owned();
    };
    let rest = &url[scheme_end..];
    let Some(at) = rest.rfind('@') else {
        return url.to_owned();
    };
    match rest[..at].find(':') {
        Some(colon) => format!(
            "{}{}:***{}",
            &url[..scheme_end],
            &rest[..colon],
            &rest[at..]
        ),
        None => url.to_owned(),
    }
}

/// A small pool (a command needs one connection; a purge or watch reuses it).
pub async fn connect(url: Option<&str>) -> Result<PgPool, Failure> {
    let Some(url) = url.filter(|u| !u.is_empty()) else {
        return Err(Failure(
            "no database given: pass --database-url postgres://user@host:5432/db or set \
             DATABASE_URL"
                .to_owned(),
        ));
    };
    let shown = redact(url);
    let options = url
        .parse::<sqlx::postgres::PgConnectOptions>()
        .map_err(|e| {
            Failure(format!(
                "the database URL {shown} is not a Postgres URL ({e}): write \
             postgres://user[:password]@host[:port]/database"
            ))
        })?;
    // One direct connection first: a pool retries until its acquire timeout and then reports
    // only that it timed out, hiding the cause (refused, unknown host, bad password).
    let probe = sqlx::PgConnection::connect_with(&options)
        .await
        .map_err(|e| Failure(unreachable(&shown, &e)))?;
    probe.close().await.ok();
    PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .map_err(|e| Failure(unreachable(&shown, &e)))
}

/// Why the first connection failed, by cause.
fn unreachable(shown: &str, e: &sqlx::Error) -> String {
    if let sqlx::Error::Database(db) = e {
        return match db.code().as_deref() {
            Some("28P01") | Some("28000") => format!(
                "Postgres at {shown} refused the login ({}): check the user and password in \
                 the URL",
                db.message()
            ),
            Some("3D000") => format!(
                "{} at {shown}: create it (createdb) or fix the database name in the URL",
                db.message()
            ),
            _ => format!(
                "Postgres at {shown} refused the connection: {}",
                db.message()
            ),
        };
    }
    format!(
        "cannot reach Postgres at {shown} ({e}): check that the server is running and that \
         --database-url / DATABASE_URL points at it"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(
            redact("postgres://app:s3cret@db:5432/prod"),
            "postgres://app:***@db:5432/prod"
        );
        assert_eq!(redact("postgres://app@db/prod"), "postgres://app@db/prod");
        assert_eq!(redact("not a url"), "not a url");
    }
}
