//! Names (SPEC §1): the configurable schema, table and dead-letter table, the identifiers
//! derived from them, and the [`Outbox`] handle that carries them with its prepared SQL.

use std::sync::{Arc, OnceLock};

use crate::error::{Error, Result};

/// Postgres truncates identifiers longer than `NAMEDATALEN - 1` bytes; we reject them instead,
/// because a silently truncated index name would make two tables collide.
pub(crate) const MAX_IDENTIFIER_BYTES: usize = 63;

/// The default queue table name (SPEC §1).
pub const DEFAULT_TABLE: &str = "outbox";

/// Quotes an identifier for SQL text: `my "t"` becomes `"my ""t"""`.
pub(crate) fn quote_ident(name: &str) -> String {
    let mut s = String::with_capacity(name.len() + 2);
    s.push('"');
    for c in name.chars() {
        if c == '"' {
            s.push('"');
        }
        s.push(c);
    }
    s.push('"');
    s
}

/// Quotes a string literal for SQL text (standard_conforming_strings is on since 9.1).
pub(crate) fn quote_literal(value: &str) -> String {
    let mut s = String::with_capacity(value.len() + 2);
    s.push('\'');
    for c in value.chars() {
        if c == '\'' {
            s.push('\'');
        }
        s.push(c);
    }
    s.push('\'');
    s
}

/// Every identifier the product uses for one configuration, unquoted, plus their quoted
/// forms ready to paste into SQL text.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    pub table_name: String,
    pub dlq_name: String,
    /// `"schema"."table"` or `"table"`.
    pub qtable: String,
    /// `"schema"."dlq"` or `"dlq"`.
    pub qdlq: String,
    pub pending_idx: String,
    pub lease_idx: String,
    pub timer_uq: String,
    pub lease_ck: String,
    pub rearm_ck: String,
    pub dlq_idx: String,
    /// The LISTEN/NOTIFY channel (SPEC §2.4).
    pub channel: String,
}

impl Names {
    fn new(schema: Option<String>, table: String, dlq_table: Option<String>) -> Result<Self> {
        let dlq_table = dlq_table.unwrap_or_else(|| format!("{table}_dlq"));
        if let Some(s) = &schema {
            check_identifier(s)?;
        }
        check_identifier(&table)?;
        check_identifier(&dlq_table)?;
        let qualify = |n: &str| match &schema {
            Some(s) => format!("{}.{}", quote_ident(s), quote_ident(n)),
            None => quote_ident(n),
        };
        // The channel carries the schema when one is configured, so two tables of the same
        // name in different schemas do not wake each other's workers.
        let channel = match &schema {
            Some(s) => format!("{s}.{table}_wakeup"),
            None => format!("{table}_wakeup"),
        };
        let names = Names {
            qtable: qualify(&table),
            qdlq: qualify(&dlq_table),
            pending_idx: format!("{table}_pending_idx"),
            lease_idx: format!("{table}_lease_idx"),
            timer_uq: format!("{table}_timer_id_uq"),
            lease_ck: format!("{table}_lease_ck"),
            rearm_ck: format!("{table}_rearm_ck"),
            dlq_idx: format!("{dlq_table}_queue_failed_at_idx"),
            channel,
            table_name: table,
            dlq_name: dlq_table,
        };
        // The sequences and primary keys Postgres names for us would be truncated silently;
        // check them together with ours.
        let implicit = [
            format!("{}_id_seq", names.table_name),
            format!("{}_pkey", names.table_name),
            format!("{}_id_seq", names.dlq_name),
            format!("{}_pkey", names.dlq_name),
        ];
        for id in [
            &names.pending_idx,
            &names.lease_idx,
            &names.timer_uq,
            &names.lease_ck,
            &names.rearm_ck,
            &names.dlq_idx,
            &names.channel,
        ]
        .into_iter()
        .chain(implicit.iter())
        {
            check_identifier(id)?;
        }
        Ok(names)
    }

    /// The qualified table name as a SQL string literal, for `'...'::regclass`.
    pub(crate) fn table_literal(&self) -> String {
        quote_literal(&self.qtable)
    }
}

fn check_identifier(id: &str) -> Result<()> {
    let bad = |reason: String| {
        Err(Error::InvalidName {
            identifier: id.to_owned(),
            reason,
        })
    };
    if id.is_empty() {
        return bad("is empty".into());
    }
    if id.len() > MAX_IDENTIFIER_BYTES {
        return bad(format!(
            "is {} bytes long; postgres identifiers hold at most {MAX_IDENTIFIER_BYTES} bytes",
            id.len()
        ));
    }
    if id.contains('\0') {
        return bad("contains a NUL byte".into());
    }
    // The migrations wrap statements in a dollar-quoted DO block with this tag.
    if id.contains("$outbox$") {
        return bad("contains `$outbox$`, which the migrations use as a quote tag".into());
    }
    Ok(())
}

/// A configured outbox: which schema, table and dead-letter table to use, with every SQL
/// statement prepared once for those names.
///
/// Cheap to clone (an `Arc`). Build one with [`Outbox::builder`] or take the defaults with
/// [`Outbox::default`] (table `outbox`, dead-letter table `outbox_dlq`, both in the
/// connection's `search_path`, dead-letter queue off).
///
/// ```
/// let outbox = outbox::Outbox::builder()
///     .schema("jobs")
///     .table("Presence Timers")
///     .dead_letter(true)
///     .build()?;
/// # Ok::<(), outbox::Error>(())
/// ```
#[derive(Clone)]
pub struct Outbox {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub names: Names,
    pub dead_letter: bool,
    pub sql: crate::store::postgres::Sql,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox")
            .field("table", &self.inner.names.qtable)
            .field("dead_letter_table", &self.inner.names.qdlq)
            .field("dead_letter", &self.inner.dead_letter)
            .finish()
    }
}

impl Default for Outbox {
    fn default() -> Self {
        // The defaults are valid names, so this cannot fail; a test keeps it that way.
        OutboxBuilder::default()
            .build()
            .expect("the default outbox names are valid")
    }
}

static GLOBAL: OnceLock<Outbox> = OnceLock::new();

impl Outbox {
    /// Starts a configuration with the defaults of SPEC §1.
    pub fn builder() -> OutboxBuilder {
        OutboxBuilder::default()
    }

    /// The outbox used by the functions `#[timer]` generates when they are handed a plain
    /// connection or transaction: the one given to [`Outbox::set_global`], or
    /// [`Outbox::default`] if none was.
    pub fn global() -> &'static Outbox {
        GLOBAL.get_or_init(Outbox::default)
    }

    /// Makes this outbox the process-wide one (see [`Outbox::global`]). Call it once, at
    /// start-up, before the first publish. Returns the outbox back as an error if a global
    /// outbox was already in use.
    pub fn set_global(self) -> std::result::Result<(), Outbox> {
        GLOBAL.set(self)
    }

    /// The quoted, schema-qualified queue table, as it appears in SQL text.
    pub fn table(&self) -> &str {
        &self.inner.names.qtable
    }

    /// The quoted, schema-qualified dead-letter table, as it appears in SQL text.
    pub fn dead_letter_table(&self) -> &str {
        &self.inner.names.qdlq
    }

    /// Whether terminal failures are archived to the dead-letter table.
    pub fn dead_letter_enabled(&self) -> bool {
        self.inner.dead_letter
    }

    /// The channel workers `LISTEN` on and publishes notify (SPEC §2.4).
    pub fn channel(&self) -> &str {
        &self.inner.names.channel
    }

    pub(crate) fn names(&self) -> &Names {
        &self.inner.names
    }

    pub(crate) fn sql(&self) -> &crate::store::postgres::Sql {
        &self.inner.sql
    }
}

/// Builder for [`Outbox`]; see there.
#[derive(Debug, Clone)]
pub struct OutboxBuilder {
    schema: Option<String>,
    table: String,
    dlq_table: Option<String>,
    dead_letter: bool,
}

impl Default for OutboxBuilder {
    fn default() -> Self {
        OutboxBuilder {
            schema: None,
            table: DEFAULT_TABLE.to_owned(),
            dlq_table: None,
            dead_letter: false,
        }
    }
}

impl OutboxBuilder {
    /// Puts both tables in this schema instead of the connection's `search_path`.
    /// The schema must exist (see [`crate::migrate`]'s notes).
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// The queue table name (default `outbox`). Any characters are allowed: every statement
    /// quotes it, so `"jobs.outbox"` is a table with a dot in its name (use
    /// [`OutboxBuilder::schema`] for a schema). Names derived from it must fit Postgres'
    /// 63-byte identifiers; the longest is the dead-letter index
    /// `<table>_dlq_queue_failed_at_idx`, so in practice the table name holds at most 39
    /// bytes (with the default dead-letter table name).
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// The dead-letter table name (default `<table>_dlq`). Setting it turns the
    /// dead-letter queue on.
    pub fn dead_letter_table(mut self, table: impl Into<String>) -> Self {
        self.dlq_table = Some(table.into());
        self.dead_letter = true;
        self
    }

    /// Turns archiving of terminal failures to the dead-letter table on or off (default off:
    /// SPEC §1.2 makes the dead-letter queue opt-in). Off, a terminal failure deletes the row.
    pub fn dead_letter(mut self, on: bool) -> Self {
        self.dead_letter = on;
        self
    }

    /// Checks the names and prepares every statement.
    ///
    /// # Errors
    /// [`Error::InvalidName`] naming the first identifier that is empty, holds a NUL byte or
    /// would exceed 63 bytes (the table name itself, or a derived index, constraint or
    /// channel name such as `<table>_timer_id_uq`).
    pub fn build(self) -> Result<Outbox> {
        let names = Names::new(self.schema, self.table, self.dlq_table)?;
        let sql = crate::store::postgres::Sql::new(&names);
        Ok(Outbox {
            inner: Arc::new(Inner {
                names,
                dead_letter: self.dead_letter,
                sql,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
    }

    #[test]
    fn default_is_valid() {
        let o = Outbox::default();
        assert_eq!(o.table(), "\"outbox\"");
        assert_eq!(o.dead_letter_table(), "\"outbox_dlq\"");
        assert_eq!(o.channel(), "outbox_wakeup");
        assert!(!o.dead_letter_enabled());
    }

    #[test]
    fn schema_and_odd_names_are_quoted() {
        let o = Outbox::builder()
            .schema("My Schema")
            .table("Presence \"T\"")
            .build()
            .unwrap();
        assert_eq!(o.table(), "\"My Schema\".\"Presence \"\"T\"\"\"");
        assert_eq!(o.channel(), "My Schema.Presence \"T\"_wakeup");
    }

    #[test]
    fn derived_identifier_overflow_is_named() {
        // 55 bytes: the table fits, `<t>_pending_idx` (67 bytes) does not.
        let t = "t".repeat(55);
        let err = Outbox::builder().table(t.clone()).build().unwrap_err();
        match err {
            Error::InvalidName { identifier, .. } => {
                assert_eq!(identifier, format!("{t}_pending_idx"))
            }
            other => panic!("unexpected {other:?}"),
        }
        let long = "x".repeat(64);
        let err = Outbox::builder().table(long.clone()).build().unwrap_err();
        assert!(matches!(err, Error::InvalidName { identifier, .. } if identifier == long));
        assert!(Outbox::builder().table("").build().is_err());
        assert!(Outbox::builder().schema("a\0b").build().is_err());
    }
}
