//! Connecting, and turning what goes wrong into a sentence that says what to do.

use std::fmt::Write as _;
use std::time::Duration;

use outbox::Error;
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgPool};

/// The guide's section on the grants each command needs.
pub const ROLES_GUIDE: &str =
    "https://github.com/outbox-rs/outbox/blob/main/docs/guide/deployment.md#a-runtime-role-without-ddl-rights";

/// A failure the command reports: the library's error (explained in main, with the tables the
/// command ran on), or a message with its exit status.
#[derive(Debug)]
pub enum Failure {
    /// An error of the library, explained with [`Target`] when reported.
    Lib(Error),
    /// A finished sentence and the exit status it ends the process with.
    Message {
        /// What happened and what to do.
        text: String,
        /// 1 for a failure, 2 for a usage error.
        code: u8,
    },
}

impl Failure {
    /// A usage error (exit status 2): the command line asked for something impossible.
    pub fn usage(text: impl Into<String>) -> Failure {
        Failure::Message {
            text: text.into(),
            code: 2,
        }
    }

    /// A failure of the operation (exit status 1).
    pub fn failed(text: impl Into<String>) -> Failure {
        Failure::Message {
            text: text.into(),
            code: 1,
        }
    }

    /// The exit status: 2 for usage errors, including the library's rejected arguments and
    /// names (refused before any SQL), 1 for everything else.
    pub fn exit_code(&self) -> u8 {
        match self {
            Failure::Lib(Error::InvalidArgument { .. } | Error::InvalidName { .. }) => 2,
            Failure::Lib(_) => 1,
            Failure::Message { code, .. } => *code,
        }
    }

    /// The sentence to print, naming the commands to run for `target`.
    pub fn render(&self, target: &Target) -> String {
        match self {
            Failure::Lib(e) => explain(e, target),
            Failure::Message { text, .. } => text.clone(),
        }
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::Lib(e)
    }
}

impl From<sqlx::Error> for Failure {
    fn from(e: sqlx::Error) -> Self {
        Failure::Lib(Error::from(e))
    }
}

/// The tables a command ran on, as given on its command line: what a piece of advice must
/// repeat so that the command it names works on the same tables.
#[derive(Debug, Clone, Default)]
pub struct Target {
    /// `--schema`, when given.
    pub schema: Option<String>,
    /// `--table`, when not the default `outbox`.
    pub table: Option<String>,
    /// `--dead-letter-table`, when given.
    pub dead_letter_table: Option<String>,
    /// The command ran with the dead-letter table on (`--dead-letter`, or a `dlq` command).
    pub dead_letter: bool,
    /// `--distributed`, when given: advice without it would run on the single-node layout
    /// and be refused.
    pub distributed: Option<u16>,
}

impl Target {
    /// `outbox [--schema S] [--table T] [--dead-letter-table D] [--distributed N] <sub>[ --dead-letter]`.
    pub fn command(&self, sub: &str) -> String {
        let mut c = "outbox".to_owned();
        for (flag, value) in [
            ("--schema", &self.schema),
            ("--table", &self.table),
            ("--dead-letter-table", &self.dead_letter_table),
        ] {
            if let Some(v) = value {
                let _ = write!(c, " {flag} {}", shell_word(v));
            }
        }
        if let Some(n) = self.distributed {
            let _ = write!(c, " --distributed {n}");
        }
        let _ = write!(c, " {sub}");
        if self.dead_letter {
            c.push_str(" --dead-letter");
        }
        c
    }

    /// The queue table as a JSON document names it: `{"schema": …, "table": …}`, each as
    /// given on the command line (`schema` null when not given), not quoted for SQL.
    pub fn json_names(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        m.insert("schema".into(), self.schema.clone().into());
        m.insert(
            "table".into(),
            self.table.as_deref().unwrap_or("outbox").into(),
        );
        m
    }

    /// The queue table as a person names it in a message: `schema.table` (or `table`), as
    /// given on the command line, not quoted for SQL.
    pub fn table_name(&self) -> String {
        self.qualified(self.table.as_deref().unwrap_or("outbox"))
    }

    /// The dead-letter table as a person names it (as [`Target::table_name`]).
    pub fn dead_letter_table_name(&self) -> String {
        match &self.dead_letter_table {
            Some(d) => self.qualified(d),
            None => format!("{}_dlq", self.table_name()),
        }
    }

    /// `table` with `--schema` before it, when given.
    fn qualified(&self, table: &str) -> String {
        match &self.schema {
            Some(schema) => format!("{schema}.{table}"),
            None => table.to_owned(),
        }
    }

    /// A missing column a statement reported (bare, or already `table.column`), with the
    /// table it belongs to: the dead-letter table's own columns, the queue table's own,
    /// or either for the columns both have.
    pub fn column(&self, object: &str) -> String {
        const DEAD_LETTER_ONLY: [&str; 6] = [
            "original_id",
            "failed_at",
            "failure_reason",
            "last_error",
            "redriven_at",
            "redriven_id",
        ];
        const SHARED: [&str; 8] = [
            "id",
            "queue",
            "payload",
            "headers",
            "timer_id",
            "attempts_count",
            "deliveries_count",
            "created_at",
        ];
        if object.contains('.') {
            object.to_owned()
        } else if DEAD_LETTER_ONLY.contains(&object) {
            format!("{}.{object}", self.dead_letter_table_name())
        } else if SHARED.contains(&object) {
            format!(
                "{object} (of {} or {})",
                self.table_name(),
                self.dead_letter_table_name()
            )
        } else {
            format!("{}.{object}", self.table_name())
        }
    }

    /// The migrate command for these tables.
    pub fn migrate(&self) -> String {
        self.command("migrate")
    }
}

/// `s` quoted for a POSIX shell when it holds anything but plain name characters.
fn shell_word(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
    {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The library's error, with the instruction an operator at a shell needs: the command to
/// run (with this command's tables and dead-letter setting) rather than the function to call.
pub fn explain(e: &Error, target: &Target) -> String {
    let migrate = target.migrate();
    match e {
        Error::NotMigrated { detail } => {
            // Postgres reports a table of a schema that does not exist as a missing table;
            // `migrate` would then refuse for the schema (a fresh-user trial).
            let schema = match &target.schema {
                Some(s) => format!(" (create the schema {s} first if it does not exist)"),
                None => String::new(),
            };
            format!(
                "the outbox tables do not exist ({detail}): run `{migrate}`{schema}, or check \
                 that --schema/--table name your application's tables"
            )
        }
        Error::UpgradeRequired { detail } => format!(
            "the schema lacks what this command needs ({detail}): run `{migrate}` (what each \
             step adds and locks: {})",
            outbox::schema::UPGRADE_GUIDE
        ),
        Error::SchemaNotFound { detail } => {
            format!("{detail}: create the schema first (CREATE SCHEMA …), then run `{migrate}`")
        }
        // From any command but `validate` (which lists the problems itself): the table
        // named is not an outbox table (or not of this version).
        Error::SchemaMismatch { problems } if problems.iter().all(|p| !p.needs_upgrade) => {
            let missing: Vec<String> = problems.iter().map(|p| target.column(&p.object)).collect();
            format!(
                "the tables these options name are not outbox tables (missing: {}): check \
                 that --schema, --table and --dead-letter-table name your application's \
                 tables; `{}` lists every difference",
                missing.join(", "),
                target.command("validate")
            )
        }
        Error::MigrationBlocked { .. } => format!(
            "{e}; run `{migrate}` again once those sessions are done (or give it longer with \
             --deadline)"
        ),
        Error::SessionRequired { what, why } => format!(
            "`{what}` needs a server session of its own ({why}), which a transaction-mode \
             pooler does not keep: run `{migrate}` without --transaction-pooler, with a \
             --database-url that reaches the Postgres server itself"
        ),
        Error::Database(sqlx::Error::Database(db)) if db.code().as_deref() == Some("42501") => {
            let table = target.table.as_deref().unwrap_or("outbox");
            format!(
                "{}: the role in the database URL lacks a grant. `migrate` must run as the \
                 tables' owner; workers and publishers need SELECT, INSERT, UPDATE, DELETE on \
                 the outbox tables; pausing and resuming need INSERT, DELETE on {table}_paused. \
                 Grant what is missing (or use the owner's role); see {ROLES_GUIDE}",
                db.message()
            )
        }
        // The library names its own settings; here they are options of the command line.
        Error::InvalidArgument { field, reason }
        | Error::InvalidConfig {
            knob: field,
            reason,
        } if option_of(field).is_some() => {
            format!("invalid {}: {reason}", option_of(field).unwrap_or_default())
        }
        other => other.to_string(),
    }
}

/// The command-line option that sets the library's setting `field`, if one does.
fn option_of(field: &str) -> Option<&'static str> {
    Some(match field {
        "lease_ttl" => "--lease-ttl",
        "lock_timeout" => "--lock-timeout",
        "deadline" => "--deadline",
        "older_than" => "--older-than",
        "batch_size" => "--batch-size",
        _ => return None,
    })
}

/// The connection string with its password replaced, for messages: the password of a URL's
/// user part, a `password=` parameter of a URL's query, and a `password=` pair of a
/// `key=value` connection string (quoted or not).
pub fn redact(url: &str) -> String {
    match url.find("://") {
        Some(i) => redact_url(url, i + 3),
        None => redact_pairs(url),
    }
}

fn redact_url(url: &str, scheme_end: usize) -> String {
    let (head, query) = match url.find('?') {
        Some(q) => (&url[..q], Some(&url[q + 1..])),
        None => (url, None),
    };
    let rest = &head[scheme_end..];
    let mut out = match rest.rfind('@') {
        Some(at) => match rest[..at].find(':') {
            Some(colon) => format!(
                "{}{}:***{}",
                &head[..scheme_end],
                &rest[..colon],
                &rest[at..]
            ),
            None => head.to_owned(),
        },
        None => head.to_owned(),
    };
    if let Some(query) = query {
        out.push('?');
        let pairs: Vec<String> = query
            .split('&')
            .map(|pair| match pair.split_once('=') {
                Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
                _ => pair.to_owned(),
            })
            .collect();
        out.push_str(&pairs.join("&"));
    }
    out
}

/// `host=h password=secret` or `password = 'a b'`: each password value becomes `***`.
fn redact_pairs(dsn: &str) -> String {
    let mut out = String::with_capacity(dsn.len());
    let mut rest = dsn;
    loop {
        // The next `password` key at the start of the text or after whitespace.
        let found = rest.match_indices("password").find(|(i, _)| {
            rest[..*i]
                .chars()
                .next_back()
                .is_none_or(char::is_whitespace)
        });
        let Some((i, _)) = found else {
            out.push_str(rest);
            return out;
        };
        let after_key = &rest[i + "password".len()..];
        let trimmed = after_key.trim_start();
        let Some(value) = trimmed.strip_prefix('=') else {
            out.push_str(&rest[..i + "password".len()]);
            rest = after_key;
            continue;
        };
        let value = value.trim_start();
        out.push_str(&rest[..i]);
        out.push_str("password=***");
        rest = skip_value(value);
    }
}

/// What follows a `key=value` value: a quoted value ends at its unescaped closing quote,
/// a bare one at whitespace.
fn skip_value(value: &str) -> &str {
    if let Some(quoted) = value.strip_prefix('\'') {
        let mut escaped = false;
        for (i, c) in quoted.char_indices() {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '\'' => return &quoted[i + 1..],
                _ => {}
            }
        }
        ""
    } else {
        let end = value.find(char::is_whitespace).unwrap_or(value.len());
        &value[end..]
    }
}

/// A small pool (a command needs one connection; a purge or watch reuses it).
pub async fn connect(url: Option<&str>) -> Result<PgPool, Failure> {
    let Some(url) = url.filter(|u| !u.is_empty()) else {
        return Err(Failure::usage(
            "no database given: pass --database-url postgres://user@host:5432/db or set \
             DATABASE_URL",
        ));
    };
    let shown = redact(url);
    if let Some(i) = url.find("://") {
        let scheme = &url[..i];
        if !scheme.eq_ignore_ascii_case("postgres") && !scheme.eq_ignore_ascii_case("postgresql") {
            return Err(Failure::usage(format!(
                "the database URL {shown} is a {scheme}:// URL: outbox works on Postgres only; \
                 write postgres://user[:password]@host[:port]/database"
            )));
        }
    }
    let options = url
        .parse::<sqlx::postgres::PgConnectOptions>()
        .map_err(|e| {
            Failure::usage(format!(
                "the database URL {shown} is not a Postgres URL ({e}): write \
                 postgres://user[:password]@host[:port]/database"
            ))
        })?;
    // One direct connection first: a pool retries until its acquire timeout and then reports
    // only that it timed out, hiding the cause (refused, unknown host, bad password).
    let probe = sqlx::PgConnection::connect_with(&options)
        .await
        .map_err(|e| Failure::failed(unreachable(&shown, &e)))?;
    probe.close().await.ok();
    PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options)
        .await
        .map_err(|e| Failure::failed(unreachable(&shown, &e)))
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
    // The binary is built without TLS (sqlx's TLS features, unified into every build of
    // the workspace, made its tests refuse the X.509 v1 certificate Citus generates, even
    // with sslmode=prefer: lab notes of 2026-12-05). Said plainly, not "is it running?".
    if matches!(e, sqlx::Error::Tls(_)) {
        return format!(
            "cannot connect to Postgres at {shown} with TLS ({e}): this build of the outbox \
             command has no TLS; connect without sslmode=require/verify-ca/verify-full (on a \
             trusted network, or through a local TLS tunnel to the server)"
        );
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
        assert_eq!(
            redact("postgres:///db?host=h&user=u&password=secret&port=1"),
            "postgres:///db?host=h&user=u&password=***&port=1"
        );
        assert_eq!(
            redact("postgres://a:b@h/db?password=c&sslmode=require"),
            "postgres://a:***@h/db?password=***&sslmode=require"
        );
        assert_eq!(
            redact("host=h user=u password=secret dbname=d"),
            "host=h user=u password=*** dbname=d"
        );
        assert_eq!(
            redact("host=h password = 'a b\\' c' dbname=d"),
            "host=h password=*** dbname=d"
        );
        assert_eq!(redact("password=x"), "password=***");
        assert_eq!(redact("host=h mypassword=x"), "host=h mypassword=x");
    }

    #[test]
    fn a_library_setting_is_named_as_its_option() {
        let t = Target::default();
        let e = Error::InvalidArgument {
            field: "lease_ttl",
            reason: "must be above zero".into(),
        };
        assert_eq!(explain(&e, &t), "invalid --lease-ttl: must be above zero");
        let e = Error::InvalidArgument {
            field: "queue",
            reason: "is empty".into(),
        };
        assert_eq!(explain(&e, &t), e.to_string());
    }

    #[test]
    fn a_missing_column_names_the_table_it_belongs_to() {
        let t = Target {
            schema: Some("app".into()),
            table: Some("jobs".into()),
            dead_letter_table: None,
            dead_letter: false,
            distributed: None,
        };
        assert_eq!(t.column("original_id"), "app.jobs_dlq.original_id");
        assert_eq!(t.column("acquired_token"), "app.jobs.acquired_token");
        assert_eq!(t.column("payload"), "payload (of app.jobs or app.jobs_dlq)");
        assert_eq!(t.column("jobs.queue"), "jobs.queue");
        let t = Target {
            schema: None,
            table: None,
            dead_letter_table: Some("events".into()),
            ..t
        };
        assert_eq!(t.column("failed_at"), "events.failed_at");
        assert_eq!(t.column("next_attempt_at"), "outbox.next_attempt_at");
    }

    #[test]
    fn advice_repeats_the_tables_and_the_dead_letter_setting() {
        let t = Target {
            schema: Some("s".into()),
            table: Some("t".into()),
            dead_letter_table: None,
            dead_letter: true,
            distributed: None,
        };
        assert_eq!(
            t.migrate(),
            "outbox --schema s --table t migrate --dead-letter"
        );
        let citus = Target {
            distributed: Some(32),
            ..t.clone()
        };
        assert_eq!(
            citus.migrate(),
            "outbox --schema s --table t --distributed 32 migrate --dead-letter"
        );
        let e = Error::UpgradeRequired {
            detail: "column \"redriven_at\" does not exist".into(),
        };
        let text = explain(&e, &t);
        assert!(
            text.contains("run `outbox --schema s --table t migrate --dead-letter`"),
            "{text}"
        );
        assert!(text.contains("lacks what this command needs"), "{text}");
        assert!(!text.contains("predates"), "{text}");
        assert_eq!(Target::default().migrate(), "outbox migrate");
        let odd = Target {
            table: Some("it's".into()),
            ..Target::default()
        };
        assert_eq!(odd.migrate(), r"outbox --table 'it'\''s' migrate");
    }
}
