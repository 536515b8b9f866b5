//! `/queues/{queue}`: its live rows by deadline, keyset-paginated, filtered by state,
//! searched by id or timer id; pause, resume, cancel a timer.

use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Redirect, Response};
use chrono::{DateTime, Utc};
use maud::html;
use serde::Deserialize;

use crate::format;
use crate::layout::{self, encode, Base, Kind, Named, Notice};
use crate::pages::queues::state;
use crate::sql::{self, ListedRow, StateFilter};
use crate::state::State as Shared;

#[derive(Debug, Default, Deserialize)]
pub(crate) struct Params {
    state: Option<String>,
    /// The last row of the previous page: `<deadline in microseconds since 1970>_<id>`.
    after: Option<String>,
    /// An id or a timer id.
    q: Option<String>,
}

/// The cursor of a page: `<deadline in µs since 1970>_<id>`.
fn cursor(r: &ListedRow) -> String {
    format!("{}_{}", r.next_attempt_at.timestamp_micros(), r.id)
}

fn parse_cursor(s: &str) -> Option<(DateTime<Utc>, i64)> {
    let (at, id) = s.split_once('_')?;
    let at = DateTime::from_timestamp_micros(at.parse().ok()?)?;
    Some((at, id.parse().ok()?))
}

/// `/queue?name=…`: the page of any queue name.
pub(crate) async fn by_name(
    State(s): State<Shared>,
    base: Base,
    Query(n): Query<Named>,
    Query(p): Query<Params>,
    Query(notice): Query<Notice>,
) -> Response {
    match n.name {
        Some(queue) => show(s, base, queue, p, notice).await,
        None => layout::bad_request(&base, &s, "which queue? the address needs ?name=<queue>"),
    }
}

/// `/queues/{queue}`: the older address, for names a path can carry.
pub(crate) async fn page(
    State(s): State<Shared>,
    base: Base,
    Path(queue): Path<String>,
    Query(p): Query<Params>,
    Query(notice): Query<Notice>,
) -> Response {
    show(s, base, queue, p, notice).await
}

async fn show(s: Shared, base: Base, queue: String, p: Params, notice: Notice) -> Response {
    let bad = |reason: String| layout::bad_request(&base, &s, &reason);
    if let Err(reason) = valid_name(&queue) {
        return bad(format!("bad queue name: {reason}"));
    }
    let filter = match p.state.as_deref().filter(|s| !s.is_empty()) {
        None => StateFilter::All,
        Some(name) => match StateFilter::parse(name) {
            Some(f) => f,
            None => {
                return bad(format!(
                    "unknown state {name:?}: use all, pending, due or leased"
                ))
            }
        },
    };
    let after = match p.after.as_deref().filter(|s| !s.is_empty()) {
        None => None,
        Some(c) => match parse_cursor(c) {
            Some(c) => Some(c),
            None => return bad(format!("bad page cursor {c:?}: follow the Next link")),
        },
    };
    let mut conn = match s.pool.acquire().await {
        Ok(c) => c,
        Err(e) => return layout::failed(&base, &s, &e),
    };
    let mut notice = notice;
    if let Some(q) = p.q.as_deref().filter(|q| !q.is_empty()) {
        // The value as typed first (ids are byte-exact: ` sp ` and `sp` are two rows);
        // only when it finds nothing, the value without surrounding spaces.
        let found = match search(&s, &mut conn, &queue, q).await {
            Ok(None) if q.trim() != q && !q.trim().is_empty() => {
                search(&s, &mut conn, &queue, q.trim()).await
            }
            other => other,
        };
        match found {
            Ok(Some(id)) => return Redirect::to(&base.to(&format!("/rows/{id}"))).into_response(),
            Ok(None) => {
                notice = Notice::local(Kind::Error, format!(
                    "no live row of {queue} has the id or timer id \"{q}\" (it may have completed, been cancelled or dead-lettered)"
                ))
            }
            Err(e) => return layout::failed(&base, &s, &e),
        }
    }
    let limit = i64::try_from(s.page_size).unwrap_or(50);
    // One row more than a page: a "Next page" only when there is one.
    let mut rows = match sql::list(
        &s.sql,
        &s.outbox,
        &mut conn,
        filter,
        &queue,
        after,
        limit + 1,
    )
    .await
    {
        Ok(r) => r,
        Err(e) => return layout::failed(&base, &s, &e),
    };
    let more = rows.len() > s.page_size;
    rows.truncate(s.page_size);
    let paused = match s.outbox.paused_queues(&mut conn).await {
        Ok(p) => p
            .into_iter()
            .find(|p| p.queue == queue)
            .map(|p| p.paused_at),
        Err(e) => return layout::failed(&base, &s, &e),
    };
    let now = match sql::now(&s.outbox, &mut conn).await {
        Ok(n) => n,
        Err(e) => return layout::failed(&base, &s, &e),
    };
    drop(conn);
    let here = base.to(&layout::queue_path(&queue, None));
    let next = more
        .then(|| rows.last().map(cursor))
        .flatten()
        .map(|c| format!("{here}&state={}&after={c}", filter.as_str()));
    let body = html! {
        div.bar {
            a href=(base.to("/")) { "All queues" } " · "
            (state(&s, &base, &queue, paused, now)) " · "
            a href=(base.to(&format!("/dead-letters?queue={}", encode(&queue)))) { "Dead letters of " (queue) }
        }
        form.filters method="get" action=(base.to("/queue")) role="search" {
            input type="hidden" name="name" value=(queue);
            label { "Id or timer id" input type="search" name="q" value=(p.q.as_deref().unwrap_or("")); }
            label { "State"
                select name="state" {
                    @for f in StateFilter::EVERY {
                        option value=(f.as_str()) selected[f == filter] { (f.as_str()) }
                    }
                }
            }
            button type="submit" { "Show" }
        }
        @if !s.read_only {
            form.filters method="post" action=(base.to(&layout::queue_path(&queue, Some("cancel")))) {
                input type="hidden" name="csrf" value=(s.csrf);
                label { "Cancel the timer keyed" input type="text" name="timer_id" required; }
                button.danger type="submit" { "Cancel timer" }
            }
        }
        @if rows.is_empty() {
            p { "No " (if filter == StateFilter::All { "live" } else { filter.as_str() }) " row" @if after.is_some() { " after this point" } "." }
        } @else {
            table {
                caption.muted { "Live rows by deadline, then id (" (rows.len()) " shown)." }
                thead { tr {
                    th scope="col" { "Id" }
                    th scope="col" { "Timer id" }
                    th scope="col" { "State" }
                    th scope="col" { "Deadline" }
                    th.num scope="col" { "Attempts" }
                    th.num scope="col" { "Deliveries" }
                    th scope="col" { "Queued rearm" }
                    th.num scope="col" { "Payload" }
                    @if !s.read_only { th scope="col" { "Actions" } }
                } }
                tbody {
                    @for r in &rows {
                        tr {
                            th scope="row" { a href=(base.to(&format!("/rows/{}", r.id))) { (r.id) } }
                            td { (r.timer_id.as_deref().unwrap_or("–")) }
                            td { (row_state(r, now, s.lease_ttl)) }
                            td { (when(r.next_attempt_at, now)) }
                            td.num { (r.attempts) }
                            td.num { (r.deliveries) }
                            td { @match r.rearm_at { Some(t) => (when(t, now)), None => "–" } }
                            td.num { (r.payload_bytes) " B" }
                            @if !s.read_only { td {
                                @if r.acquired_at.is_none() {
                                    (layout::button(&s, &base.to(&format!("/rows/{}/run-now", r.id)), &[], "Run now", ""))
                                    (layout::button(&s, &base.to(&format!("/rows/{}/delete", r.id)), &[], "Delete", "danger"))
                                } @else if let Some(ago) = r.acquired_at.and_then(|at| lease_expired_for(at, now, s.lease_ttl)) {
                                    span.expired { "lease expired " (format::span(ago.num_seconds())) " ago: claimable again" }
                                    @if let (Some(timer), None) = (&r.timer_id, r.cancelled_at) {
                                        " " (layout::button(&s, &base.to(&layout::queue_path(&queue, Some("cancel"))), &[("timer_id", timer)], "Cancel timer", "danger"))
                                    }
                                } @else {
                                    span.muted { "held by a worker" }
                                }
                            } }
                        }
                    }
                }
            }
        }
        p.pager {
            @if after.is_some() { a href=(format!("{here}&state={}", filter.as_str())) { "First page" } " " }
            @if let Some(next) = next { a href=(next) rel="next" { "Next page" } }
        }
    };
    layout::page(
        &base,
        &s,
        &format!("Queue {queue}"),
        "queues",
        &notice,
        false,
        body,
    )
    .into_response()
}

/// The library's rule for queue names and timer ids (checked here so a bad one in a URL is
/// a 400, not a database error): 1 to 255 bytes, no NUL.
pub(crate) fn valid_name(name: &str) -> Result<(), &'static str> {
    match name.len() {
        0 => Err("it is empty"),
        n if n > 255 => Err("it is longer than 255 bytes"),
        _ if name.contains('\0') => Err("it contains NUL"),
        _ => Ok(()),
    }
}

/// A row's id from a search: an id of a live row of `queue`, else a timer id of it.
async fn search(
    s: &Shared,
    conn: &mut sqlx::PgConnection,
    queue: &str,
    q: &str,
) -> sqlx::Result<Option<i64>> {
    if let Ok(id) = q.parse::<i64>() {
        if let Some(row) = sql::row(&s.sql, &s.outbox, conn, id).await? {
            if row.queue == queue {
                return Ok(Some(id));
            }
        }
    }
    if valid_name(q).is_err() {
        return Ok(None);
    }
    sql::by_timer(&s.sql, &s.outbox, conn, queue, q).await
}

pub(crate) fn row_state(
    r: &ListedRow,
    now: DateTime<Utc>,
    ttl: std::time::Duration,
) -> &'static str {
    let expired = r
        .acquired_at
        .is_some_and(|at| lease_expired_for(at, now, ttl).is_some());
    match (r.acquired_at.is_some(), expired, r.cancelled_at.is_some()) {
        (true, true, true) => "lease expired, cancelled",
        (true, true, false) => "lease expired",
        (true, false, true) => "leased, cancelled",
        (true, false, false) => "leased",
        (false, _, _) if r.next_attempt_at <= now => "due",
        (false, _, _) => "pending",
    }
}

/// How long ago a lease taken at `acquired_at` expired (the workers' lease TTL after it),
/// or `None` while it holds. An expired lease is claimable again: the next claim of its
/// queue takes the row (or deletes it, when it was cancelled while it ran).
pub(crate) fn lease_expired_for(
    acquired_at: DateTime<Utc>,
    now: DateTime<Utc>,
    ttl: std::time::Duration,
) -> Option<chrono::Duration> {
    let ttl = chrono::Duration::from_std(ttl).unwrap_or(chrono::Duration::MAX);
    let end = acquired_at.checked_add_signed(ttl)?;
    (end < now).then(|| now - end)
}

/// A time in UTC with its relative age.
pub(crate) fn when(t: DateTime<Utc>, now: DateTime<Utc>) -> maud::Markup {
    html! {
        time datetime=(t.to_rfc3339()) title=(format::utc(t)) {
            (format::utc(t)) " " small { "(" (format::relative(t, now)) ")" }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_refuse_garbage() {
        let r = ListedRow {
            id: 42,
            timer_id: None,
            next_attempt_at: DateTime::from_timestamp_micros(1_800_000_000_123_456).unwrap(),
            acquired_at: None,
            attempts: 0,
            deliveries: 0,
            rearm_at: None,
            cancelled_at: None,
            payload_bytes: 0,
        };
        assert_eq!(parse_cursor(&cursor(&r)), Some((r.next_attempt_at, 42)));
        assert_eq!(parse_cursor("x_1"), None);
        assert_eq!(parse_cursor("12"), None);
    }
}
