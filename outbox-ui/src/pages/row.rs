//! `/rows/{id}`: one live row, every column, and the actions a pending row allows.

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use maud::{html, Markup};

use crate::format;
use crate::layout::{self, Base, Kind, Notice};
use crate::limits::MAX_SHOWN_BYTES;
use crate::pages::queue::{lease_expired_for, when};
use crate::sql;
use crate::state::State as Shared;

pub(crate) async fn page(
    State(s): State<Shared>,
    base: Base,
    Path(id): Path<String>,
    Query(notice): Query<Notice>,
) -> Response {
    let Some(id) = id.parse::<i64>().ok().filter(|id| *id > 0) else {
        return layout::bad_request(
            &base,
            &s,
            &format!("bad row id {id:?}: row ids are positive integers"),
        );
    };
    let row = match s.pool.acquire().await {
        Ok(mut conn) => sql::row(&s.sql, &s.outbox, &mut conn, id).await,
        Err(e) => Err(e),
    };
    let r = match row {
        Ok(Some(r)) => r,
        Ok(None) => {
            // The action's own notice when it signed one (a delete says so), else why the
            // page is empty.
            let n = if notice
                .shown(&s.notice_key, chrono::Utc::now().timestamp())
                .is_some()
            {
                notice
            } else {
                Notice::local(Kind::Error, format!("no live row has id {id}: it completed, was cancelled, deleted or dead-lettered, or never existed"))
            };
            let body = html! { p { a href=(base.to("/")) { "Back to the queues" } } };
            return (
                StatusCode::NOT_FOUND,
                layout::page(&base, &s, &format!("Row {id}"), "queues", &n, false, body),
            )
                .into_response();
        }
        Err(e) => return layout::failed(&base, &s, &e),
    };
    let now = r.now;
    let expired = r
        .acquired_at
        .and_then(|at| lease_expired_for(at, now, s.lease_ttl));
    let queue_url = base.to(&layout::queue_path(&r.queue, None));
    let act = |what: &str| base.to(&format!("/rows/{id}/{what}"));
    let dl = |what: &str| base.to(&format!("/rows/{id}/download/{what}"));
    let body = html! {
        p { a href=(queue_url) { "Queue " (r.queue) } }
        dl.facts {
            dt { "Queue" } dd { (r.queue) }
            dt { "Timer id" } dd { (r.timer_id.as_deref().unwrap_or("– (not keyed)")) }
            dt { "State" } dd {
                @match (&r.acquired_at, &r.acquired_token) {
                    (Some(at), Some(token)) => {
                        @if let Some(ago) = expired {
                            strong { "lease expired " (format::span(ago.num_seconds())) " ago" }
                            " (lease TTL " (format::span(i64::try_from(s.lease_ttl.as_secs()).unwrap_or(i64::MAX))) "): no worker holds it now; the next claim of its queue takes it again"
                            @if r.cancelled_at.is_some() && r.rearm_at.is_none() { " (or deletes it: it was cancelled while it ran)" }
                            ". Lease token " code { (token) } ", claimed " (when(*at, now)) "."
                        } @else {
                            "leased by lease token " code { (token) } ", claimed " (when(*at, now))
                            " (lease age " (format::span((now - *at).num_seconds())) ")"
                        }
                    }
                    _ => @if r.next_attempt_at <= now { "due (pending)" } @else { "pending" },
                }
            }
            dt { "Deadline" } dd { (when(r.next_attempt_at, now)) }
            dt { "Created" } dd { (when(r.created_at, now)) }
            dt { "First attempt" } dd { (opt(r.first_attempt_at, now)) }
            dt { "Last attempt" } dd { (opt(r.last_attempt_at, now)) }
            dt { "Attempts" } dd { (r.attempts) }
            dt { "Deliveries" } dd { (r.deliveries) }
            dt { "Queued rearm" } dd { (opt(r.rearm_at, now)) }
            dt { "Cancel mark" } dd { (opt(r.cancelled_at, now)) }
        }
        h2 { "Payload (" (r.payload.len()) " bytes)" }
        (payload(&r.payload, MAX_SHOWN_BYTES, &dl("payload")))
        h2 { "Headers" }
        (headers(r.headers.as_ref(), MAX_SHOWN_BYTES, &dl("headers")))
        @if r.rearm_at.is_some() {
            h2 { "Queued rearm's payload" }
            @match &r.rearm_payload { Some(p) => (payload(p, MAX_SHOWN_BYTES, &dl("rearm-payload"))), None => p { "– (the row's own)" } }
            h2 { "Queued rearm's headers" }
            (headers(r.rearm_headers.as_ref(), MAX_SHOWN_BYTES, &dl("rearm-headers")))
        }
        @if !s.read_only {
            h2 { "Actions" }
            @if expired.is_some() {
                p { "Its lease expired, but the row is still leased: run now, reschedule and delete leave a leased row alone (the library's rule) until a worker claims it again and its run ends." }
                @if r.cancelled_at.is_some() {
                    p { "Its timer is already cancelled: the next claim deletes it." }
                } @else if let Some(timer) = &r.timer_id {
                    p { "Cancelling its timer marks the row: the next claim deletes it instead of running it." }
                    div.bar {
                        (layout::button(&s, &base.to(&layout::queue_path(&r.queue, Some("cancel"))), &[("timer_id", timer)], "Cancel timer", "danger"))
                    }
                }
            } @else if r.acquired_at.is_some() {
                p { "A worker holds this row: no action until its run ends or its lease expires." }
            } @else {
                div.bar {
                    (layout::button(&s, &act("run-now"), &[], "Run now", ""))
                    (layout::button(&s, &act("delete"), &[], "Delete row", "danger"))
                    @if let (Some(timer), None) = (&r.timer_id, r.cancelled_at) {
                        (layout::button(&s, &base.to(&layout::queue_path(&r.queue, Some("cancel"))), &[("timer_id", timer)], "Cancel timer", "danger"))
                    }
                }
                form.filters method="post" action=(act("reschedule")) {
                    input type="hidden" name="csrf" value=(s.csrf);
                    label { "Due in (e.g. 30s, 5m, 2h)" input type="text" name="in" required; }
                    button type="submit" { "Reschedule" }
                }
            }
        }
    };
    layout::page(
        &base,
        &s,
        &format!("Row {}", r.id),
        "queues",
        &notice,
        false,
        body,
    )
    .into_response()
}

fn opt(t: Option<chrono::DateTime<chrono::Utc>>, now: chrono::DateTime<chrono::Utc>) -> Markup {
    match t {
        Some(t) => when(t, now),
        None => html! { "–" },
    }
}

/// JSON when the bytes parse as JSON, else a hex dump; escaped either way; at most `cap`
/// bytes of the payload, with how much that is and the link to `download` the raw bytes.
pub(crate) fn payload(bytes: &[u8], cap: usize, download: &str) -> Markup {
    let shown = format::shown(bytes, cap);
    html! {
        @if shown.cut() {
            p.muted.cut {
                @if shown.json {
                    "Showing the first " (shown.shown) " of " (shown.total) " bytes of the JSON, re-indented. "
                } @else {
                    "Not JSON: showing the first " (shown.shown) " of " (shown.total) " bytes. "
                }
                a href=(download) download { "Download the raw payload" }
            }
        } @else if !shown.json {
            p.muted { "Not JSON: the raw bytes. " a href=(download) download { "Download" } }
        }
        pre.payload data-format=(if shown.json { "json" } else { "bytes" }) { (shown.text) }
    }
}

/// The headers as a table, at most `cap` bytes of names and values (each value cut where
/// the budget ends), with the link to `download` them whole when cut.
pub(crate) fn headers(h: Option<&serde_json::Value>, cap: usize, download: &str) -> Markup {
    match h.and_then(|v| v.as_object()) {
        Some(map) if !map.is_empty() => {
            let mut budget = cap;
            let mut rows = Vec::new();
            for (k, v) in map {
                if budget == 0 {
                    break;
                }
                let value = v.as_str().map_or_else(|| v.to_string(), str::to_owned);
                let name = format::clip(k, budget).into_owned();
                budget = budget.saturating_sub(k.len());
                let shown = format::clip(&value, budget.max(1)).into_owned();
                budget = budget.saturating_sub(value.len());
                rows.push((name, shown));
            }
            let total: usize = map
                .iter()
                .map(|(k, v)| k.len() + v.as_str().map_or_else(|| v.to_string().len(), str::len))
                .sum();
            html! {
                table.headers {
                    thead { tr { th scope="col" { "Name" } th scope="col" { "Value" } } }
                    tbody {
                        @for (k, v) in &rows {
                            tr {
                                th scope="row" { code { (k) } }
                                td { code { (v) } }
                            }
                        }
                    }
                }
                @if total > cap {
                    p.muted.cut {
                        "Showing " (rows.len()) " of " (map.len()) " headers, " (cap) " of their " (total) " bytes. "
                        a href=(download) download { "Download the headers" }
                    }
                }
            }
        }
        Some(_) => html! { p { "None." } },
        None => match h {
            None | Some(serde_json::Value::Null) => html! { p { "None." } },
            Some(other) => raw_headers(&other.to_string(), cap, download),
        },
    }
}

/// Headers stored as something other than a string map, as text, cut at `cap` bytes.
pub(crate) fn raw_headers(text: &str, cap: usize, download: &str) -> Markup {
    html! {
        pre { (format::clip(text, cap)) }
        @if text.len() > cap {
            p.muted.cut { a href=(download) download { "Download the headers" } }
        }
    }
}
