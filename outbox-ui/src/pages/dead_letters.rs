//! `/dead-letters`: the dead-letter table by id, filtered by queue, reason and redrive
//! state; redrive one, redrive every match of a page, purge by age (confirmed).

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use maud::html;
use outbox::dlq::DeadLetterFilter;
use outbox::store::FailureReason;
use serde::Deserialize;

use crate::format;
use crate::layout::{self, encode, Base, Notice};
use crate::limits::LIST_SHOWN_BYTES;
use crate::pages::queue::{valid_name, when};
use crate::pages::row::{headers, payload, raw_headers};
use crate::sql;
use crate::state::State as Shared;

/// Every reason a dead letter can have.
pub(crate) const REASONS: [FailureReason; 6] = [
    FailureReason::MaxDeliveries,
    FailureReason::RetryExhausted,
    FailureReason::Rejected,
    FailureReason::DecodeError,
    FailureReason::Timeout,
    FailureReason::Aborted,
];

/// The filter fields of the page and of "redrive every match".
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Params {
    pub queue: Option<String>,
    pub reason: Option<String>,
    /// "on" to list redriven dead letters too.
    pub redriven: Option<String>,
    /// List after this dead-letter id.
    pub after: Option<String>,
}

/// The library's filter from the page's fields, or why they are wrong.
pub(crate) fn filter(p: &Params) -> Result<DeadLetterFilter, String> {
    // The checkbox sends "on" or nothing; anything else is refused, not read as off.
    let redriven = match p.redriven.as_deref() {
        None | Some("") => false,
        Some("on") => true,
        Some(other) => return Err(format!("bad redriven {other:?}: \"on\" or nothing")),
    };
    let mut f = DeadLetterFilter::new().include_redriven(redriven);
    if let Some(q) = p.queue.as_deref().filter(|q| !q.is_empty()) {
        valid_name(q).map_err(|r| format!("bad queue name: {r}"))?;
        f = f.queue(q);
    }
    if let Some(r) = p.reason.as_deref().filter(|r| !r.is_empty()) {
        let reason = REASONS
            .into_iter()
            .find(|x| x.as_str() == r)
            .ok_or_else(|| {
                format!(
                    "unknown failure reason {r:?}: use one of {}",
                    REASONS.map(FailureReason::as_str).join(", ")
                )
            })?;
        f = f.reason(reason);
    }
    Ok(f)
}

pub(crate) async fn page(
    State(s): State<Shared>,
    base: Base,
    Query(p): Query<Params>,
    Query(notice): Query<Notice>,
) -> Response {
    if !s.outbox.dead_letter_enabled() {
        let body = html! {
            p { "Dead letters are off for this outbox: a row that fails for good is deleted, not archived, so there is nothing to list." }
            p.muted { "To keep them: " code { "OutboxBuilder::dead_letter(true)" } " in the application, or " code { "outbox ui --dead-letter" } " from the command line (after " code { "outbox migrate --dead-letter" } ")." }
        };
        return layout::page(
            &base,
            &s,
            "Dead letters",
            "dead-letters",
            &notice,
            false,
            body,
        )
        .into_response();
    }
    let bad = |reason: String| layout::bad_request(&base, &s, &reason);
    let f = match filter(&p) {
        Ok(f) => f,
        Err(e) => return bad(e),
    };
    let after = match p.after.as_deref().filter(|a| !a.is_empty()) {
        None => None,
        Some(a) => match a.parse::<i64>() {
            Ok(id) => Some(id),
            Err(_) => return bad(format!("bad page cursor {a:?}: follow the Next link")),
        },
    };
    let read = async {
        let mut conn = s.pool.acquire().await?;
        let rows = s
            .outbox
            .dead_letters(&mut conn, &f, after, s.page_size + 1)
            .await?;
        let now = sql::now(&s.outbox, &mut conn).await?;
        Ok::<_, outbox::Error>((rows, now))
    };
    // One more than a page was read: a "Next page" only when there is one.
    let (mut rows, now) = match read.await {
        Ok(r) => r,
        Err(e) => return layout::failed(&base, &s, &e),
    };
    let more = rows.len() > s.page_size;
    rows.truncate(s.page_size);
    let queue = p.queue.clone().unwrap_or_default();
    let reason = p.reason.clone().unwrap_or_default();
    let redriven = p.redriven.as_deref() == Some("on");
    let here = base.to("/dead-letters");
    let query = format!(
        "queue={}&reason={}{}",
        encode(&queue),
        encode(&reason),
        if redriven { "&redriven=on" } else { "" }
    );
    let next = more
        .then(|| {
            rows.last()
                .map(|d| format!("{here}?{query}&after={}", d.id))
        })
        .flatten();
    let body = html! {
        form.filters method="get" action=(here) {
            label { "Queue" input type="text" name="queue" value=(queue); }
            label { "Reason"
                select name="reason" {
                    option value="" selected[reason.is_empty()] { "any" }
                    @for r in REASONS {
                        option value=(r.as_str()) selected[reason == r.as_str()] { (r.as_str()) }
                    }
                }
            }
            label { "Redriven too" input type="checkbox" name="redriven" value="on" checked[redriven]; }
            button type="submit" { "Filter" }
        }
        @if rows.is_empty() {
            p { "No dead letter matches." }
        } @else {
            table {
                caption.muted { "Dead letters by id (" (rows.len()) " shown)." }
                thead { tr {
                    th scope="col" { "Id" }
                    th scope="col" { "Queue" }
                    th scope="col" { "Timer id" }
                    th scope="col" { "Reason" }
                    th scope="col" { "Failed" }
                    th.num scope="col" { "Attempts" }
                    th scope="col" { "Last error" }
                    th scope="col" { "Message" }
                    th scope="col" { @if s.read_only { "Redriven" } @else { "Redrive" } }
                } }
                tbody {
                    @for d in &rows {
                        tr {
                            th scope="row" { (d.id) br; small.muted { "was row " (d.original_id) } }
                            td { (d.queue) }
                            td { (d.timer_id.as_deref().unwrap_or("–")) }
                            td { (d.failure_reason) }
                            td { (when(d.failed_at, now)) }
                            td.num { (d.attempts_count) }
                            td { @match &d.last_error { Some(e) => pre.error { (format::clip(e, LIST_SHOWN_BYTES)) }, None => "–" } }
                            td {
                                details {
                                    summary { (d.payload.len()) " bytes" }
                                    @let dl = |what: &str| base.to(&format!("/dead-letters/{}/download/{what}", d.id));
                                    (payload(&d.payload, LIST_SHOWN_BYTES, &dl("payload")))
                                    @let h = d.headers.as_ref().map(|h| serde_json::json!(h));
                                    @if let Some(raw) = &d.raw_headers { (raw_headers(raw, LIST_SHOWN_BYTES, &dl("headers"))) } @else { (headers(h.as_ref(), LIST_SHOWN_BYTES, &dl("headers"))) }
                                }
                            }
                            td {
                                @match (d.redriven_at, d.redriven_id) {
                                    (Some(at), Some(id)) => { "as " a href=(base.to(&format!("/rows/{id}"))) { "row " (id) } " " (format::relative(at, now)) }
                                    (Some(at), None) => { "redriven " (format::relative(at, now)) }
                                    _ if s.read_only => "–",
                                    _ => (layout::button(&s, &base.to("/dead-letters/redrive"), &[("id", &d.id.to_string())], "Redrive", "")),
                                }
                            }
                        }
                    }
                }
            }
            p.pager { @if let Some(next) = next { a href=(next) rel="next" { "Next page" } } }
        }
        @if !s.read_only {
            h2 { "Redrive every match" }
            p { "Re-publishes up to " (s.page_size) " dead letters matching the filter above (not yet redriven), oldest id first, with the same rules as " code { "outbox dlq redrive --all" } "." }
            (layout::button(&s, &base.to("/dead-letters/redrive"), &[("queue", &queue), ("reason", &reason)], "Redrive matching", ""))
            h2 { "Purge" }
            form.filters method="post" action=(base.to("/dead-letters/purge")) {
                input type="hidden" name="csrf" value=(s.csrf);
                label { "Older than (e.g. 7d, 12h)" input type="text" name="older_than" required; }
                label { "Queue (empty: every queue)" input type="text" name="queue" value=(queue); }
                button.danger type="submit" { "Purge…" }
            }
        }
    };
    layout::page(
        &base,
        &s,
        "Dead letters",
        "dead-letters",
        &notice,
        false,
        body,
    )
    .into_response()
}
