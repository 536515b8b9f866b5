//! Identifiers: the configured schema, table and dead-letter table, every name derived from
//! them, quoting, and Postgres' 63-byte rule. The leaf every statement is rendered from.

use crate::bucket::Buckets;
use crate::error::{Error, Result};

/// Postgres truncates identifiers longer than `NAMEDATALEN - 1` bytes; we reject them instead,
/// because a silently truncated index name would make two tables collide.
pub(crate) const MAX_IDENTIFIER_BYTES: usize = 63;

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
    /// The quoted schema, when one is configured.
    pub qschema: Option<String>,
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
    pub cancel_ck: String,
    pub dlq_idx: String,
    /// `(failed_at)` on the dead-letter table: purges by age.
    pub dlq_failed_idx: String,
    /// The table that records applied migration steps.
    pub versions_name: String,
    /// Its quoted, qualified form.
    pub qversions: String,
    /// The table of paused queues (`<table>_paused`).
    pub paused_name: String,
    /// Its quoted, qualified form.
    pub qpaused: String,
    /// The LISTEN/NOTIFY channel: `<table>_wakeup`, schema-qualified with an explicit
    /// schema.
    pub channel: String,
    /// Whether statements notify `channel` when they make a row due (default true; an
    /// `Outbox` built with `notify(false)` renders them without `pg_notify`).
    pub notify: bool,
    /// Distributed mode (Citus): the bucket layout; `None` for a single node.
    pub buckets: Option<Buckets>,
    /// The CHECK that bounds the bucket column (distributed mode).
    pub bucket_ck: String,
    /// The sequences of row ids in distributed mode, quoted and qualified.
    pub qid_seq: String,
    pub qdlq_id_seq: String,
}

impl Names {
    pub(crate) fn new(
        schema: Option<String>,
        table: String,
        dlq_table: Option<String>,
    ) -> Result<Self> {
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
            qschema: schema.as_deref().map(quote_ident),
            qtable: qualify(&table),
            qdlq: qualify(&dlq_table),
            pending_idx: format!("{table}_pending_idx"),
            lease_idx: format!("{table}_lease_idx"),
            timer_uq: format!("{table}_timer_id_uq"),
            lease_ck: format!("{table}_lease_ck"),
            rearm_ck: format!("{table}_rearm_ck"),
            cancel_ck: format!("{table}_cancel_ck"),
            dlq_idx: format!("{dlq_table}_queue_failed_at_idx"),
            dlq_failed_idx: format!("{dlq_table}_failed_at_idx"),
            qversions: qualify(&format!("{table}_schema_migrations")),
            versions_name: format!("{table}_schema_migrations"),
            qpaused: qualify(&format!("{table}_paused")),
            paused_name: format!("{table}_paused"),
            channel,
            notify: true,
            buckets: None,
            bucket_ck: format!("{table}_bucket_ck"),
            qid_seq: qualify(&format!("{table}_id_seq")),
            qdlq_id_seq: qualify(&format!("{dlq_table}_id_seq")),
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
            format!("{}_pkey", names.paused_name),
        ];
        for id in [
            &names.pending_idx,
            &names.lease_idx,
            &names.timer_uq,
            &names.lease_ck,
            &names.rearm_ck,
            &names.cancel_ck,
            &names.dlq_idx,
            &names.dlq_failed_idx,
            &names.versions_name,
            &names.paused_name,
            &names.channel,
            &names.bucket_ck,
        ]
        .into_iter()
        .chain(implicit.iter())
        {
            check_identifier(id)?;
        }
        // Every table of the outbox needs a name of its own: a dead-letter table named like
        // the queue table (or like a table the migrations create beside it) would make the
        // migrations skip a table that "exists" and every later statement fail.
        let tables = [
            ("the queue table", &names.table_name),
            ("the table of applied migration steps", &names.versions_name),
            ("the table of paused queues", &names.paused_name),
        ];
        if let Some((what, _)) = tables.iter().find(|(_, n)| **n == names.dlq_name) {
            return Err(Error::InvalidName {
                identifier: names.dlq_name.clone(),
                reason: format!("names {what} too; the dead-letter table needs a name of its own"),
            });
        }
        Ok(names)
    }

    /// The quoted schema to put before an object's name, when one is configured.
    pub(crate) fn schema_prefix(&self) -> Option<&str> {
        self.qschema.as_deref()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::DEFAULT_TABLE;

    #[test]
    fn quoting() {
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
    }

    #[test]
    fn derived_identifier_overflow_is_named() {
        // 55 bytes: the table fits, `<t>_pending_idx` (67 bytes) does not.
        let t = "t".repeat(55);
        let err = Names::new(None, t.clone(), None).unwrap_err();
        match err {
            Error::InvalidName { identifier, .. } => {
                assert_eq!(identifier, format!("{t}_pending_idx"))
            }
            other => panic!("unexpected {other:?}"),
        }
        let long = "x".repeat(64);
        let err = Names::new(None, long.clone(), None).unwrap_err();
        assert!(matches!(err, Error::InvalidName { identifier, .. } if identifier == long));
        assert!(Names::new(None, String::new(), None).is_err());
        assert!(Names::new(Some("a\0b".into()), DEFAULT_TABLE.into(), None).is_err());
    }

    /// Found by the issue-16 trial: a dead-letter table named like the queue table passed
    /// `build()` and failed in the migrations with "column failed_at does not exist".
    #[test]
    fn the_dead_letter_table_needs_a_name_of_its_own() {
        for (dlq, what) in [
            ("jobs", "the queue table"),
            ("jobs_paused", "the table of paused queues"),
            (
                "jobs_schema_migrations",
                "the table of applied migration steps",
            ),
        ] {
            let err = Names::new(None, "jobs".into(), Some(dlq.into())).unwrap_err();
            match err {
                Error::InvalidName { identifier, reason } => {
                    assert_eq!(identifier, dlq);
                    assert!(reason.contains(what), "{reason}");
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert!(Names::new(None, "jobs".into(), Some("jobs_failed".into())).is_ok());
    }
}
