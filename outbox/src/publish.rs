//! Executing a publish and a batch: the statements `sql::publish` renders, each in its
//! `send` span, with the W3C trace context written into the headers (feature
//! `opentelemetry`). What a message is and the rules it must follow are `message`'s.
//!
//! Everything here runs on the **caller's** connection or transaction: the library never
//! commits or rolls back the caller's transaction, so a message exists if and only if it
//! commits (the transactional outbox). Through a transaction-mode pooler a connection that
//! is in no transaction gets a short one of the library's around the statement (`scope`).

use chrono::{DateTime, Utc};
use sqlx::postgres::types::PgInterval;
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::types::Json;
use sqlx::{PgConnection, Row};
use tracing::{Instrument, Span};

use crate::error::{Error, OutboxSql, Result};
use crate::message::envelope::{Message, Published};
use crate::message::{
    slack_micros, validate_batch, BatchItem, Headers, OnConflict, Schedule, MAX_HEADERS_BYTES,
};
use crate::scope::{BindBucket, Scope};
use crate::sql;
use crate::sql::binds::interval;
use crate::telemetry;

/// The `send` span of one message.
pub(crate) fn send_span(message: &Message<'_>) -> Span {
    telemetry::send_span(message.queue, message.timer_id, None)
}

/// Records what a publish did on its `send` span.
pub(crate) fn sent(span: &Span, result: &Result<Published>) {
    match result {
        Ok(published) => {
            if let Some(id) = published.id() {
                span.record("messaging.message.id", id);
            }
            telemetry::outcome(
                span,
                match published {
                    Published::Inserted { .. } => "inserted",
                    Published::Skipped => "skipped",
                    Published::Extended { .. } => "extended",
                    Published::RearmQueued { .. } => "rearm_queued",
                    Published::Unchanged => "unchanged",
                },
            );
        }
        Err(e) => telemetry::error(span, e.variant()),
    }
}

/// The message's headers with the W3C trace context of `span` added (`traceparent`, and
/// `tracestate` when not empty), or `None` to publish the headers as they are: without the
/// feature, without an OpenTelemetry context, when the caller's headers hold a
/// `traceparent` already (theirs win), or when the added context would take the headers
/// past [`MAX_HEADERS_BYTES`] (the publish goes on without it).
pub(crate) fn with_trace_context(span: &Span, headers: Option<&Headers>) -> Option<Headers> {
    if headers.is_some_and(|h| h.contains_key(telemetry::TRACEPARENT_HEADER)) {
        return None;
    }
    add_trace_context(span, headers, telemetry::trace_context(span)?)
}

/// The headers of a batch's items with the trace context of the batch's `send` span added
/// (as [`with_trace_context`] decides for each item); `None` when nothing is added.
pub(crate) fn batch_trace_context(
    span: &Span,
    items: &[BatchItem<'_>],
) -> Option<Vec<Option<Headers>>> {
    if items.is_empty() {
        return None;
    }
    let context = telemetry::trace_context(span)?;
    Some(
        items
            .iter()
            .map(|i| match i.headers {
                Some(h) if h.contains_key(telemetry::TRACEPARENT_HEADER) => None,
                headers => add_trace_context(span, headers, context.clone()),
            })
            .collect(),
    )
}

/// `headers` with `(traceparent, tracestate)` added, unless they would then exceed the
/// limit; a `tracestate` of the caller's stays.
fn add_trace_context(
    span: &Span,
    headers: Option<&Headers>,
    (parent, state): (String, Option<String>),
) -> Option<Headers> {
    let state =
        state.filter(|_| !headers.is_some_and(|h| h.contains_key(telemetry::TRACESTATE_HEADER)));
    let mut total = headers.map_or(0, |h| {
        h.iter().fold(0usize, |n, (k, v)| {
            n.saturating_add(k.len()).saturating_add(v.len())
        })
    });
    total = total
        .saturating_add(telemetry::TRACEPARENT_HEADER.len())
        .saturating_add(parent.len());
    if let Some(state) = &state {
        total = total
            .saturating_add(telemetry::TRACESTATE_HEADER.len())
            .saturating_add(state.len());
    }
    if total > MAX_HEADERS_BYTES {
        span.in_scope(|| {
            tracing::debug!(
                bytes = total,
                limit = MAX_HEADERS_BYTES,
                "outbox: the trace context is not written into the message's headers: with it they would exceed the header limit"
            );
        });
        return None;
    }
    let mut out = headers.cloned().unwrap_or_default();
    out.insert(telemetry::TRACEPARENT_HEADER.to_owned(), parent);
    if let Some(state) = state {
        out.insert(telemetry::TRACESTATE_HEADER.to_owned(), state);
    }
    Some(out)
}

/// `items` with the headers of [`batch_trace_context`] in place of theirs, where it added
/// a context.
pub(crate) fn traced_items<'b>(
    items: &[BatchItem<'b>],
    traced: &'b [Option<Headers>],
) -> Vec<BatchItem<'b>> {
    items
        .iter()
        .zip(traced)
        .map(|(i, t)| BatchItem {
            payload: i.payload,
            headers: t.as_ref().or(i.headers),
        })
        .collect()
}

/// Records what a batch publish did on its `send` span.
pub(crate) fn sent_batch(span: &Span, result: &Result<Vec<i64>>) {
    match result {
        Ok(_) => telemetry::outcome(span, "batch_inserted"),
        Err(e) => telemetry::error(span, e.variant()),
    }
}

/// Publishes one message on `conn` ([`crate::Outbox::publish`]), in its `send` span.
pub(crate) async fn publish(
    sql: &sql::publish::Publish,
    scope: Scope,
    conn: &mut PgConnection,
    message: Message<'_>,
    bucket: Option<i16>,
) -> Result<Published> {
    let span = send_span(&message);
    let traced = with_trace_context(&span, message.headers);
    let message = Message {
        headers: traced.as_ref().or(message.headers),
        ..message
    };
    let result = publish_untraced(sql, scope, conn, message, bucket)
        .instrument(span.clone())
        .await;
    sent(&span, &result);
    result
}

/// [`publish`] without its span.
async fn publish_untraced(
    sql: &sql::publish::Publish,
    scope: Scope,
    conn: &mut PgConnection,
    message: Message<'_>,
    bucket: Option<i16>,
) -> Result<Published> {
    let resolved = message.validate()?;
    let (delay, at) = resolved.binds();
    let mut db = scope.on(conn).await?;
    let written = match (&sql.held, message.timer_id) {
        (Some(held), Some(key)) => {
            keyed_in_steps(
                sql,
                held,
                scope,
                &mut db,
                &message,
                key,
                (delay, at),
                bucket,
            )
            .await?
        }
        _ => match message.on_conflict {
            OnConflict::Extend => extend(sql, scope, &mut db, &message, (delay, at)).await?,
            OnConflict::Ignore => {
                let statement = match message.timer_id {
                    Some(_) => &sql.insert,
                    None => &sql.plain,
                };
                let row = binds(scope.query(statement.clone()), &message, (delay, at))
                    .bucket(bucket)
                    .fetch_optional(&mut *db)
                    .await
                    .outbox_sql()?;
                match row {
                    None => None,
                    Some(r) => Some(Written::Inserted(
                        r.try_get(0).outbox_sql()?,
                        r.try_get(1).outbox_sql()?,
                    )),
                }
            }
        },
    };
    if let Some(Written::Inserted(_, wake)) = &written {
        scope
            .wake(&mut db, sql.wake.as_ref(), [wake.clone()])
            .await?;
    }
    db.done().await?;
    Ok(match written {
        // Nothing written: the key was taken, or the extend was not later.
        None => match message.on_conflict {
            OnConflict::Ignore => Published::Skipped,
            OnConflict::Extend => Published::Unchanged,
        },
        Some(Written::Inserted(id, _)) => {
            telemetry::published(message.queue, 1);
            Published::Inserted { id }
        }
        Some(Written::RearmQueued(id)) => Published::RearmQueued { id },
        Some(Written::Extended(id)) => Published::Extended { id },
    })
}

/// What a publish statement wrote.
enum Written {
    /// A new row (its id), with the wake-up payload a distributed statement returns.
    Inserted(i64, Option<String>),
    /// A rearm queued on the running row.
    RearmQueued(i64),
    /// The pending row's deadline moved.
    Extended(i64),
}

impl Written {
    /// An extend's row `(id, inserted, leased, notify)`; `None` for a NULL id (the key's
    /// row was found and left as it was).
    fn from_extend_or_kept(r: &PgRow) -> Result<Option<Written>> {
        let Some(id) = r.try_get::<Option<i64>, _>(0).outbox_sql()? else {
            return Ok(None);
        };
        let (inserted, leased): (bool, bool) =
            (r.try_get(1).outbox_sql()?, r.try_get(2).outbox_sql()?);
        Ok(Some(if inserted {
            Written::Inserted(id, r.try_get(3).outbox_sql()?)
        } else if leased {
            Written::RearmQueued(id)
        } else {
            Written::Extended(id)
        }))
    }
}

/// A message's delay (`$4`) and absolute deadline (`$5`).
type When = (PgInterval, Option<DateTime<Utc>>);

/// The message's parameters `$1..$6` of every single-row publish statement.
fn binds<'q>(
    query: Query<'q, sqlx::Postgres, PgArguments>,
    message: &Message<'q>,
    (delay, at): When,
) -> Query<'q, sqlx::Postgres, PgArguments> {
    query
        .bind(message.queue)
        .bind(message.payload)
        .bind(message.headers.map(Json))
        .bind(delay)
        .bind(at)
        .bind(message.timer_id)
}

/// How many times a keyed publish goes back to the look when its insert met a row
/// committed after the look (a distributed publish's first statement, a single node's
/// extend statement): each round means another transaction created the key while ours
/// ran, so the bound is never reached by a key that is not created and deleted again that
/// many times in a row.
pub(crate) const KEYED_ROUNDS: usize = 16;

/// An extend on a single node (see `sql::publish`): one statement, run again while its
/// insert meets a row of the key committed after the statement's snapshot (it returns no
/// row then; the next run's snapshot sees that row). Each run of a statement in a READ
/// COMMITTED transaction takes a new snapshot.
async fn extend(
    sql: &sql::publish::Publish,
    scope: Scope,
    db: &mut PgConnection,
    message: &Message<'_>,
    when: When,
) -> Result<Option<Written>> {
    for _ in 0..KEYED_ROUNDS {
        let row = binds(scope.query(sql.extend.clone()), message, when)
            .bind(interval(slack_micros(message.slack)))
            .fetch_optional(&mut *db)
            .await
            .outbox_sql()?;
        if let Some(r) = row {
            return Written::from_extend_or_kept(&r);
        }
    }
    Err(rounds_exhausted())
}

/// The error when [`KEYED_ROUNDS`] runs all met a row created after their look.
fn rounds_exhausted() -> Error {
    Error::Database(sqlx::Error::Protocol(format!(
        "the timer key was created and deleted by others {KEYED_ROUNDS} times while this extend ran"
    )))
}

/// A keyed publish in distributed mode (see `sql::publish`): the look or the rewrite of
/// the key's row, then the insert when no row was found, again while the insert meets a
/// row committed in between.
#[allow(clippy::too_many_arguments)]
async fn keyed_in_steps(
    sql: &sql::publish::Publish,
    held: &sqlx::SqlStr,
    scope: Scope,
    db: &mut PgConnection,
    message: &Message<'_>,
    key: &str,
    when: When,
    bucket: Option<i16>,
) -> Result<Option<Written>> {
    for _ in 0..KEYED_ROUNDS {
        match message.on_conflict {
            OnConflict::Ignore => {
                let rows: i64 = scope
                    .query_scalar(held.clone())
                    .bind(message.queue)
                    .bind(key)
                    .bucket(bucket)
                    .fetch_one(&mut *db)
                    .await
                    .outbox_sql()?;
                if rows > 0 {
                    return Ok(None);
                }
            }
            OnConflict::Extend => {
                let row = binds(scope.query(sql.extend.clone()), message, when)
                    .bind(interval(slack_micros(message.slack)))
                    .bucket(bucket)
                    .fetch_optional(&mut *db)
                    .await
                    .outbox_sql()?;
                if let Some(r) = row {
                    return Written::from_extend_or_kept(&r);
                }
            }
        }
        let row = binds(scope.query(sql.insert.clone()), message, when)
            .bucket(bucket)
            .fetch_optional(&mut *db)
            .await
            .outbox_sql()?;
        match (row, message.on_conflict) {
            (Some(r), _) => {
                return Ok(Some(Written::Inserted(
                    r.try_get(0).outbox_sql()?,
                    r.try_get(1).outbox_sql()?,
                )))
            }
            // Another transaction holds the key now: a skipped publish.
            (None, OnConflict::Ignore) => return Ok(None),
            (None, OnConflict::Extend) => {}
        }
    }
    Err(rounds_exhausted())
}

/// Publishes a batch on `conn` ([`crate::Outbox::publish_batch`]), in its `send` span.
pub(crate) async fn publish_batch(
    sql: &sql::publish::Publish,
    scope: Scope,
    conn: &mut PgConnection,
    queue: &str,
    items: &[BatchItem<'_>],
    schedule: Schedule,
    bucket: Option<i16>,
) -> Result<Vec<i64>> {
    let span = telemetry::send_span(queue, None, Some(items.len()));
    let traced = batch_trace_context(&span, items);
    let rebuilt;
    let items = match &traced {
        Some(traced) => {
            rebuilt = traced_items(items, traced);
            &rebuilt[..]
        }
        None => items,
    };
    let result = publish_batch_untraced(sql, scope, conn, queue, items, schedule, bucket)
        .instrument(span.clone())
        .await;
    sent_batch(&span, &result);
    result
}

/// [`publish_batch`] without its span.
async fn publish_batch_untraced(
    sql: &sql::publish::Publish,
    scope: Scope,
    conn: &mut PgConnection,
    queue: &str,
    items: &[BatchItem<'_>],
    schedule: Schedule,
    bucket: Option<i16>,
) -> Result<Vec<i64>> {
    let resolved = validate_batch(queue, items, schedule)?;
    if items.is_empty() {
        return Ok(Vec::new());
    }
    let (delay, at) = resolved.binds();
    let payloads: Vec<&[u8]> = items.iter().map(|i| i.payload).collect();
    let headers: Vec<Option<Json<&Headers>>> = items.iter().map(|i| i.headers.map(Json)).collect();
    let mut db = scope.on(conn).await?;
    let row = scope
        .query(sql.batch.clone())
        .bind(queue)
        .bind(payloads)
        .bind(headers)
        .bind(delay)
        .bind(at)
        .bucket(bucket)
        .fetch_one(&mut *db)
        .await
        .outbox_sql()?;
    scope
        .wake(&mut db, sql.wake.as_ref(), [row.try_get(1).outbox_sql()?])
        .await?;
    db.done().await?;
    let ids: Vec<i64> = row
        .try_get::<Option<Vec<i64>>, _>(0)
        .outbox_sql()?
        .unwrap_or_default();
    telemetry::published(queue, ids.len() as u64);
    Ok(ids)
}
