//! The text of every statement the runtime sends, rendered once per [`Outbox`] for its
//! names and executed elsewhere: `publish.rs`, `cancel.rs`, `admin.rs`, `read.rs`, `dlq.rs`,
//! `stats.rs`, `schema/migrate.rs`, `schema/validate.rs`, `store/postgres.rs`,
//! `store/fenced.rs`, `store/periodic.rs` and `store/listen.rs` run what is rendered here.
//!
//! This module is a leaf over [`crate::names`] (and [`crate::Error`], which `binds` returns
//! for a value no parameter can carry): it renders text and converts values, and executes
//! nothing. Every value a statement needs travels as a bind parameter; the only text pasted
//! in is quoted identifiers and literals from [`Names`], which is why `text::statement` may
//! assert the rendered text safe for sqlx.
//!
//! A statement's comment names the index, lock or race it relies on.
//!
//! [`Outbox`]: crate::Outbox

use crate::names::Names;

pub(crate) mod admin;
pub(crate) mod binds;
pub(crate) mod cancel;
pub(crate) mod catalog;
pub(crate) mod claim;
pub(crate) mod complete;
pub(crate) mod ddl;
pub(crate) mod dlq;
pub(crate) mod periodic;
pub(crate) mod publish;
pub(crate) mod read;
pub(crate) mod stats;
mod text;

/// Every statement of one [`crate::Outbox`], rendered once when it is built.
#[derive(Debug)]
pub(crate) struct Statements {
    pub publish: publish::Publish,
    pub cancel: cancel::Cancel,
    pub claim: claim::Claim,
    pub complete: complete::Complete,
    pub read: read::Read,
    pub admin: admin::Admin,
    pub dlq: dlq::Dlq,
    pub stats: stats::Stats,
    pub ddl: ddl::Ddl,
    pub periodic: periodic::Periodic,
}

impl Statements {
    pub(crate) fn render(n: &Names) -> Self {
        Statements {
            publish: publish::Publish::render(n),
            cancel: cancel::Cancel::render(n),
            claim: claim::Claim::render(n),
            complete: complete::Complete::render(n),
            read: read::Read::render(n),
            admin: admin::Admin::render(n),
            dlq: dlq::Dlq::render(n),
            stats: stats::Stats::render(n),
            ddl: ddl::Ddl::render(n),
            periodic: periodic::Periodic::render(n),
        }
    }

    /// Every statement with a name: for the snapshot test, and for the plan tests of the
    /// project's own test suite (through the test hook `Outbox::statements`).
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn all(&self) -> Vec<(&'static str, &str)> {
        let mut out = Vec::new();
        out.extend(self.publish.all());
        out.extend(self.cancel.all());
        out.extend(self.claim.all());
        out.extend(self.complete.all());
        out.extend(self.read.all());
        out.extend(self.admin.all());
        out.extend(self.dlq.all());
        out.extend(self.stats.all());
        out.extend(self.ddl.all());
        out.extend(self.periodic.all());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rendered text for the default names, so a change to any statement shows up in
    /// review as a diff of `snapshots/`.
    #[test]
    fn statements_for_the_default_names() {
        let names = Names::new(None, crate::schema::DEFAULT_TABLE.to_owned(), None)
            .expect("default names are valid");
        let rendered = Statements::render(&names);
        let mut text = String::new();
        for (name, sql) in rendered.all() {
            text.push_str(&format!("-- {name}\n{sql}\n\n"));
        }
        insta::assert_snapshot!("statements_default_names", text);
    }

    /// Without notifications no statement notifies, and every statement keeps its shape.
    #[test]
    fn statements_without_notifications() {
        let names = Names::new(None, crate::schema::DEFAULT_TABLE.to_owned(), None)
            .expect("default names are valid");
        let quiet = Names {
            notify: false,
            ..names.clone()
        };
        let with = Statements::render(&names);
        let without = Statements::render(&quiet);
        let (with, without) = (with.all(), without.all());
        assert_eq!(with.len(), without.len());
        assert!(with.iter().any(|(_, sql)| sql.contains("pg_notify")));
        for ((name, a), (_, b)) in with.iter().zip(&without) {
            assert!(!b.contains("pg_notify"), "{name} notifies");
            assert_eq!(
                a.matches("pg_notify").count(),
                b.matches("NULL::text").count() - a.matches("NULL::text").count(),
                "{name}: each notification replaced by a NULL"
            );
        }
    }
}
