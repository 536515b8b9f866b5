//! Executing a publish and a batch: the statements `sql::publish` renders, each in its
//! `send` span, with the W3C trace context written into the headers (feature
//! `opentelemetry`). What a message is and the rules it must follow are `message`'s.
//!
//! Everything here runs on the **caller's** connection or transaction: the library never
//! commits or rolls back the caller's transaction, so a message exists if and only if it
//! commits (the transactional outbox). Through a transaction-mode pooler a connection that
//! is in no transaction gets a short one of the library's around the statement (`scope`).

use sqlx::types::Json;
use sqlx::{PgConnection, Row};
use tracing::{Instrument, Span};

use crate::error::{OutboxSql, Result};
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
    let statement = match (message.on_conflict, message.timer_id) {
        (OnConflict::Extend, _) => &sql.extend,
        (OnConflict::Ignore, Some(_)) => &sql.insert,
        (OnConflict::Ignore, None) => &sql.plain,
    };
    let mut query = scope
        .query(statement.clone())
        .bind(message.queue)
        .bind(message.payload)
        .bind(message.headers.map(Json))
        .bind(delay)
        .bind(at)
        .bind(message.timer_id);
    if message.on_conflict == OnConflict::Extend {
        query = query.bind(interval(slack_micros(message.slack)));
    }
    let query = query.bucket(bucket);
    let mut db = scope.on(conn).await?;
    let row = query.fetch_optional(&mut *db).await.outbox_sql()?;
    db.done().await?;
    let inserted = |id| {
        telemetry::published(message.queue, 1);
        Published::Inserted { id }
    };
    let Some(r) = row else {
        // Nothing written: the key was taken, or the extend was not later.
        return Ok(match message.on_conflict {
            OnConflict::Ignore => Published::Skipped,
            OnConflict::Extend => Published::Unchanged,
        });
    };
    let id: i64 = r.try_get(0).outbox_sql()?;
    if message.on_conflict == OnConflict::Ignore {
        return Ok(inserted(id));
    }
    let (was_inserted, leased): (bool, bool) =
        (r.try_get(1).outbox_sql()?, r.try_get(2).outbox_sql()?);
    Ok(if was_inserted {
        inserted(id)
    } else if leased {
        Published::RearmQueued { id }
    } else {
        Published::Extended { id }
    })
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
    db.done().await?;
    let ids: Vec<i64> = row
        .try_get::<Option<Vec<i64>>, _>(0)
        .outbox_sql()?
        .unwrap_or_default();
    telemetry::published(queue, ids.len() as u64);
    Ok(ids)
}
