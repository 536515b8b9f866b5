//! What every handler shares: the outbox, the pool, the settings, the CSRF token, the
//! rendered statements and the samples behind the sparklines.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::Outbox;
use sqlx::PgPool;

use crate::history::History;
use crate::notice::NoticeKey;
use crate::sql::Statements;

pub(crate) type State = Arc<Inner>;

#[derive(Debug)]
pub(crate) struct Inner {
    pub outbox: Outbox,
    pub pool: PgPool,
    pub read_only: bool,
    pub lease_ttl: Duration,
    pub page_size: usize,
    /// The synchronizer token every form carries: 256 random bits (two v4 UUIDs), made once
    /// per dashboard; a cross-site page cannot read it.
    pub csrf: String,
    /// The key that signs the notices of action redirects (see `notice`).
    pub notice_key: NoticeKey,
    pub sql: Statements,
    pub history: Mutex<History>,
}

impl Inner {
    pub(crate) fn new(
        outbox: Outbox,
        pool: PgPool,
        read_only: bool,
        lease_ttl: Duration,
        page_size: usize,
    ) -> Self {
        let csrf = format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        let sql = Statements::render(&outbox);
        Inner {
            outbox,
            pool,
            read_only,
            lease_ttl,
            page_size,
            csrf,
            notice_key: NoticeKey::random(),
            sql,
            history: Mutex::new(History::default()),
        }
    }
}
