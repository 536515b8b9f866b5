//! Every `POST`: the guard first (read-only, origin, CSRF token), then the library's own
//! call, then a redirect (303) back to the page the form was on, with the outcome as a
//! notice. The texts follow the `outbox` command's.

use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{post, MethodRouter};
use axum::Form;
use maud::html;
use outbox::admin::RowAction;
use outbox::dlq::{DeadLetterFilter, Redrive, RedriveResult};
use outbox::Cancelled;
use serde::Deserialize;

use crate::guard;
use crate::layout::{self, encode, Base, Kind, Named, Notice};
use crate::pages::dead_letters::{self, Params};
use crate::pages::queue::valid_name;
use crate::sql;
use crate::state::State as Shared;

/// The fields any action form may carry; each action reads its own.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Fields {
    #[serde(default)]
    csrf: String,
    timer_id: Option<String>,
    #[serde(rename = "in")]
    in_: Option<String>,
    id: Option<String>,
    queue: Option<String>,
    reason: Option<String>,
    older_than: Option<String>,
    confirm: Option<String>,
    /// The page the first `POST` of a confirmed action came from (its `Referer`), carried
    /// by the confirmation page so the outcome goes back there.
    back: Option<String>,
}

/// The confirmation page of a destructive action (delete, redrive, purge): `question`, and
/// a form that posts `fields` again to `action` with `confirm=yes`; works without script.
struct Confirm<'a> {
    title: &'a str,
    question: &'a str,
    action: &'a str,
    fields: &'a [(&'a str, &'a str)],
    yes: &'a str,
    /// Where "No, go back" leads.
    no: &'a str,
}

fn confirm_page(s: &Shared, base: &Base, headers: &HeaderMap, c: Confirm<'_>) -> Response {
    let Confirm {
        title,
        question,
        action,
        fields,
        yes,
        no,
    } = c;
    let from = headers
        .get(header::REFERER)
        .and_then(|r| r.to_str().ok())
        .unwrap_or("");
    let body = html! {
        p { (question) }
        form.inline method="post" action=(action) {
            input type="hidden" name="csrf" value=(s.csrf);
            @for (name, value) in fields {
                input type="hidden" name=(name) value=(value);
            }
            input type="hidden" name="back" value=(from);
            input type="hidden" name="confirm" value="yes";
            button.danger type="submit" { (yes) }
        }
        " "
        a href=(no) { "No, go back" }
    };
    layout::page(base, s, title, "", &Notice::default(), false, body).into_response()
}

/// The headers to go back by: the confirmed form's `back` field as the `Referer` (checked
/// by [`back`] like any `Referer`), else the request's own.
fn return_headers(headers: &HeaderMap, f: &Fields) -> HeaderMap {
    match f
        .back
        .as_deref()
        .filter(|b| !b.is_empty())
        .and_then(|b| axum::http::HeaderValue::from_str(b).ok())
    {
        Some(v) => {
            let mut h = HeaderMap::new();
            h.insert(header::REFERER, v);
            h
        }
        None if f.confirm.is_some() => HeaderMap::new(),
        None => headers.clone(),
    }
}

/// The outcome of an action: a notice for the page it returns to.
enum Outcome {
    Ok(String),
    Failed(String),
}

/// Where to go back to: the path (and query, without an earlier notice) of the `Referer`
/// when it is under this dashboard, else `fallback`.
fn back(
    s: &Shared,
    base: &Base,
    headers: &HeaderMap,
    fallback: &str,
    outcome: Outcome,
) -> Response {
    let referer = headers
        .get(header::REFERER)
        .and_then(|r| r.to_str().ok())
        .and_then(|r| {
            let rest = r.split_once("://")?.1;
            let path = &rest[rest.find('/')?..];
            // Never `//host…` (a protocol-relative URL, off this site) nor a backslash.
            if path.starts_with("//") || path.contains('\\') {
                return None;
            }
            let under = path.starts_with(&format!("{}/", base.0))
                || path == base.0
                || path.starts_with(&format!("{}?", base.0));
            under.then(|| path.to_owned())
        });
    let target = referer.unwrap_or_else(|| fallback.to_owned());
    let (path, query) = target.split_once('?').unwrap_or((&target, ""));
    let mut kept: Vec<&str> = query
        .split('&')
        .filter(|kv| {
            !kv.is_empty()
                && !kv.starts_with("ok=")
                && !kv.starts_with("error=")
                && !kv.starts_with("sig=")
        })
        .collect();
    let (kind, text) = match outcome {
        Outcome::Ok(t) => (Kind::Ok, t),
        Outcome::Failed(t) => (Kind::Error, t),
    };
    let sig = s
        .notice_key
        .sign(kind, chrono::Utc::now().timestamp(), &text);
    let notice = format!(
        "{}={}&sig={sig}",
        if kind == Kind::Ok { "ok" } else { "error" },
        encode(&text)
    );
    kept.push(&notice);
    Redirect::to(&format!("{path}?{}", kept.join("&"))).into_response()
}

/// The guard: the refusal page (403) when the action may not run.
fn refused(s: &Shared, base: &Base, headers: &HeaderMap, f: &Fields) -> Option<Response> {
    guard::check(s.read_only, headers, &f.csrf, &s.csrf)
        .err()
        .map(|r| layout::error(base, s, StatusCode::FORBIDDEN, "Refused", r.text()))
}

fn queue_page(base: &Base, queue: &str) -> String {
    base.to(&layout::queue_path(queue, None))
}

/// A duration typed into a form, read by the rule the library and the `outbox` command
/// use (`outbox::periodic::parse_interval`: months and years are refused, `1M` being one
/// letter from `1m`); the error is its reason.
fn duration(field: &'static str, text: &str) -> Result<Duration, String> {
    outbox::periodic::parse_interval(field, text).map_err(|e| match e {
        outbox::Error::InvalidArgument { reason, .. } => reason,
        other => other.to_string(),
    })
}

/// The name of a queue action, from `?name=` (every name) or the older path.
fn named(n: Named) -> Result<String, Outcome> {
    n.name
        .ok_or_else(|| Outcome::Failed("which queue? the address needs ?name=<queue>".to_owned()))
}

/// What a queue's action does.
#[derive(Debug, Clone, Copy)]
pub(crate) enum QueueOp {
    Pause,
    Resume,
    /// Cancel the timer of the form's `timer_id`.
    Cancel,
}

/// The `POST` route of `op` on the queue of `?name=` (every name, including one with `/`).
pub(crate) fn on_named_queue(op: QueueOp) -> MethodRouter<Shared> {
    post(
        move |State(s): State<Shared>,
              base: Base,
              headers: HeaderMap,
              Query(n): Query<Named>,
              Form(f): Form<Fields>| async move {
            match named(n) {
                Ok(queue) => queue_action(s, base, headers, queue, f, op).await,
                Err(o) => back(&s, &base, &headers, &base.to("/"), o),
            }
        },
    )
}

/// The `POST` route of `op` on the queue of the path (the older address).
pub(crate) fn on_queue(op: QueueOp) -> MethodRouter<Shared> {
    post(
        move |State(s): State<Shared>,
              base: Base,
              headers: HeaderMap,
              Path(queue): Path<String>,
              Form(f): Form<Fields>| queue_action(s, base, headers, queue, f, op),
    )
}

async fn queue_action(
    s: Shared,
    base: Base,
    headers: HeaderMap,
    queue: String,
    f: Fields,
    op: QueueOp,
) -> Response {
    match op {
        QueueOp::Pause => toggle(s, base, headers, queue, f, true).await,
        QueueOp::Resume => toggle(s, base, headers, queue, f, false).await,
        QueueOp::Cancel => cancel_in(s, base, headers, queue, f).await,
    }
}

async fn toggle(
    s: Shared,
    base: Base,
    headers: HeaderMap,
    queue: String,
    f: Fields,
    on: bool,
) -> Response {
    if let Some(r) = refused(&s, &base, &headers, &f) {
        return r;
    }
    let run = async {
        let mut conn = s.pool.acquire().await?;
        let changed = if on {
            s.outbox.pause_queue(&mut conn, &queue).await?
        } else {
            s.outbox.resume_queue(&mut conn, &queue).await?
        };
        let empty = on && !sql::any(&s.sql, &s.outbox, &mut conn, &queue).await?;
        Ok::<_, outbox::Error>((changed, empty))
    };
    let outcome = match run.await {
        Ok((changed, empty)) => {
            let hint = if empty {
                " (no rows in it now: check the name)"
            } else {
                ""
            };
            match (on, changed) {
                (true, true) => Outcome::Ok(format!("{queue}: paused{hint}")),
                (true, false) => Outcome::Ok(format!("{queue}: already paused{hint}")),
                (false, true) => Outcome::Ok(format!("{queue}: running")),
                (false, false) => Outcome::Ok(format!("{queue} was not paused: nothing to resume")),
            }
        }
        Err(e) => Outcome::Failed(e.to_string()),
    };
    back(&s, &base, &headers, &base.to("/"), outcome)
}

/// A row action, as `outbox run-now | reschedule | delete`: in a transaction of its own;
/// a row a worker holds is left alone ([`RowAction::Leased`]).
#[derive(Debug, Clone, Copy)]
pub(crate) enum RowOp {
    RunNow,
    In(Duration),
    Delete,
}

async fn row_action(
    s: Shared,
    base: Base,
    headers: HeaderMap,
    id: String,
    f: Fields,
    op: Option<RowOp>,
) -> Response {
    if let Some(r) = refused(&s, &base, &headers, &f) {
        return r;
    }
    let page = base.to(&format!("/rows/{id}"));
    let Some(id) = id.parse::<i64>().ok().filter(|id| *id > 0) else {
        return back(
            &s,
            &base,
            &headers,
            &base.to("/"),
            Outcome::Failed(format!(
                "bad row id \"{id}\": row ids are positive integers"
            )),
        );
    };
    let op = match op {
        Some(op) => op,
        None => {
            let text = f.in_.as_deref().unwrap_or("").trim();
            match duration("delay", text) {
                Ok(d) => RowOp::In(d),
                Err(e) => {
                    return back(
                        &s,
                        &base,
                        &headers,
                        &page,
                        Outcome::Failed(format!(
                            "bad delay ({e}): say how long from now, e.g. 30s, 5m or 2h"
                        )),
                    )
                }
            }
        }
    };
    if matches!(op, RowOp::Delete) && f.confirm.as_deref() != Some("yes") {
        return confirm_page(&s, &base, &headers, Confirm {
            title: &format!("Delete row {id}?"),
            question: &format!("Delete row {id}? It will not run, and this cannot be undone (a worker that claims it first keeps it: the delete then changes nothing)."),
            action: &base.to(&format!("/rows/{id}/delete")),
            fields: &[],
            yes: "Yes, delete it",
            no: &page,
        });
    }
    let headers = return_headers(&headers, &f);
    let run = async {
        let mut tx = s.pool.begin().await?;
        let result = match op {
            RowOp::RunNow => s.outbox.run_now(&mut tx, id).await?,
            RowOp::In(d) => s.outbox.reschedule(&mut tx, id, d).await?,
            RowOp::Delete => s.outbox.delete_pending(&mut tx, id).await?,
        };
        tx.commit().await?;
        Ok::<_, outbox::Error>(result)
    };
    let result = run.await;
    // A leased row: is its lease still held, or expired (the library refuses both)?
    let expired = match &result {
        Ok(RowAction::Leased) => match s.pool.acquire().await {
            Ok(mut conn) => sql::row(&s.sql, &s.outbox, &mut conn, id)
                .await
                .ok()
                .flatten()
                .and_then(|r| {
                    r.acquired_at.and_then(|at| {
                        crate::pages::queue::lease_expired_for(at, r.now, s.lease_ttl)
                    })
                }),
            Err(_) => None,
        },
        _ => None,
    };
    let outcome = match result {
        Ok(RowAction::Rescheduled { next_attempt_at }) => Outcome::Ok(format!(
            "row {id}: due at {}",
            crate::format::utc(next_attempt_at)
        )),
        Ok(RowAction::Deleted) => Outcome::Ok(format!("row {id}: deleted; it will not run")),
        Ok(RowAction::Leased) => match expired {
            Some(ago) => Outcome::Failed(format!(
                "row {id} is leased, though its lease expired {} ago: no worker holds it, but run now, reschedule and delete leave any leased row alone (the library's rule), so nothing changed; a worker's next claim of its queue takes it",
                crate::format::span(ago.num_seconds())
            )),
            None => Outcome::Failed(format!(
                "row {id} is leased: a worker holds it (its handler runs and its lease has not expired), so nothing changed; try again once its run ends"
            )),
        },
        Ok(RowAction::NotFound) => Outcome::Failed(format!(
            "no live row has id {id}: it completed, was cancelled or deleted, or never existed"
        )),
        Ok(other) => Outcome::Failed(format!("row {id}: {other:?}")),
        Err(e) => Outcome::Failed(e.to_string()),
    };
    // A deleted row has no page left: go back to its queue's (the referer's) page.
    let fallback = if matches!(op, RowOp::Delete) {
        base.to("/")
    } else {
        page.clone()
    };
    let referer_is_row = headers
        .get(header::REFERER)
        .and_then(|r| r.to_str().ok())
        .is_some_and(|r| r.contains(&format!("/rows/{id}")));
    if matches!(op, RowOp::Delete) && referer_is_row && matches!(outcome, Outcome::Ok(_)) {
        return back(&s, &base, &HeaderMap::new(), &fallback, outcome);
    }
    back(&s, &base, &headers, &fallback, outcome)
}

/// The `POST` route of a row's action by id: `Some(op)`, or `None` for a reschedule (its
/// delay comes from the form).
pub(crate) fn on_row(op: Option<RowOp>) -> MethodRouter<Shared> {
    post(
        move |State(s): State<Shared>,
              base: Base,
              headers: HeaderMap,
              Path(id): Path<String>,
              Form(f): Form<Fields>| row_action(s, base, headers, id, f, op),
    )
}

async fn cancel_in(
    s: Shared,
    base: Base,
    headers: HeaderMap,
    queue: String,
    f: Fields,
) -> Response {
    if let Some(r) = refused(&s, &base, &headers, &f) {
        return r;
    }
    // Byte-exact: a timer id is the library's key, and ` sp ` and `sp` are two rows.
    let timer = f.timer_id.clone().unwrap_or_default();
    if let Err(reason) = valid_name(&timer) {
        return back(
            &s,
            &base,
            &headers,
            &queue_page(&base, &queue),
            Outcome::Failed(format!("bad timer id: {reason}")),
        );
    }
    if f.confirm.as_deref() != Some("yes") {
        return confirm_page(
            &s,
            &base,
            &headers,
            Confirm {
                title: "Cancel this timer?",
                question: &format!(
                    "Cancel the timer keyed \"{timer}\" of queue {queue}? Its row is deleted (or, when its lease expired, marked so the next claim deletes it) and will not run; this cannot be undone."
                ),
                action: &base.to(&layout::queue_path(&queue, Some("cancel"))),
                fields: &[("timer_id", &timer)],
                yes: "Yes, cancel the timer",
                no: &queue_page(&base, &queue),
            },
        );
    }
    let headers = return_headers(&headers, &f);
    let run = async {
        let mut tx = s.pool.begin().await?;
        // Lock the keyed row first, as the library's cancel does, so no claim lands between
        // the look and the cancel.
        let held = match sql::by_timer(&s.sql, &s.outbox, &mut tx, &queue, &timer).await? {
            // A lease that expired is no worker's any more: its cancel marks the row,
            // which the next claim then deletes (the library's rule for a cancelled row
            // whose lease expired).
            Some(id) => sql::row(&s.sql, &s.outbox, &mut tx, id)
                .await?
                .is_some_and(|r| {
                    r.acquired_at.is_some_and(|at| {
                        crate::pages::queue::lease_expired_for(at, r.now, s.lease_ttl).is_none()
                    })
                }),
            None => false,
        };
        if held {
            return Ok::<_, outbox::Error>(None);
        }
        let c = s.outbox.cancel(&mut tx, &queue, &timer).await?;
        tx.commit().await?;
        Ok(Some(c))
    };
    let outcome = match run.await {
        Ok(None) => Outcome::Failed(format!(
            "timer \"{timer}\" of {queue}: a worker holds its row (its handler runs): nothing changed; the dashboard acts only on rows no worker holds"
        )),
        Ok(Some(Cancelled::Deleted { id })) => Outcome::Ok(format!("timer \"{timer}\" of {queue} cancelled: row {id} deleted")),
        Ok(Some(Cancelled::NotFound)) => Outcome::Failed(format!("no live row of {queue} holds the timer key \"{timer}\"")),
        Ok(Some(Cancelled::Running { id } | Cancelled::RearmDropped { id })) => Outcome::Ok(format!("timer \"{timer}\" of {queue} cancelled: row {id}'s lease expired, so it is marked cancelled; the next claim deletes it instead of running it")),
        Ok(Some(other)) => Outcome::Ok(format!("timer \"{timer}\" of {queue}: {other:?}")),
        Err(e) => Outcome::Failed(e.to_string()),
    };
    let to_queue = matches!(outcome, Outcome::Ok(_));
    if to_queue {
        // The row's page is gone: back to the queue.
        return back(
            &s,
            &base,
            &HeaderMap::new(),
            &queue_page(&base, &queue),
            outcome,
        );
    }
    back(&s, &base, &headers, &queue_page(&base, &queue), outcome)
}

/// Redrives one dead letter (`id`) or every match of the filter fields (at most a page),
/// as `outbox dlq redrive`.
pub(crate) async fn redrive(
    State(s): State<Shared>,
    base: Base,
    headers: HeaderMap,
    Form(f): Form<Fields>,
) -> Response {
    if let Some(r) = refused(&s, &base, &headers, &f) {
        return r;
    }
    let fallback = base.to("/dead-letters");
    let selection = match f.id.as_deref().filter(|i| !i.is_empty()) {
        Some(id) => match id.parse::<i64>() {
            Ok(id) => Redrive::id(id),
            Err(_) => {
                return back(
                    &s,
                    &base,
                    &headers,
                    &fallback,
                    Outcome::Failed(format!("bad dead-letter id \"{id}\"")),
                )
            }
        },
        None => {
            let params = Params {
                queue: f.queue.clone(),
                reason: f.reason.clone(),
                redriven: None,
                after: None,
            };
            match dead_letters::filter(&params) {
                Ok(filter) => Redrive::matching(filter, s.page_size),
                Err(e) => return back(&s, &base, &headers, &fallback, Outcome::Failed(e)),
            }
        }
    };
    if f.confirm.as_deref() != Some("yes") {
        let id = f.id.clone().unwrap_or_default();
        let queue = f.queue.clone().unwrap_or_default();
        let reason = f.reason.clone().unwrap_or_default();
        let question = if id.is_empty() {
            format!(
                "Redrive up to {} dead letters not yet redriven{}{}, oldest first? Each is published again as a new row of its queue.",
                s.page_size,
                if queue.is_empty() { String::new() } else { format!(" of queue {queue}") },
                if reason.is_empty() { String::new() } else { format!(" that failed with {reason}") },
            )
        } else {
            format!("Redrive dead letter {id}? It is published again as a new row of its queue.")
        };
        return confirm_page(
            &s,
            &base,
            &headers,
            Confirm {
                title: "Redrive dead letters?",
                question: &question,
                action: &base.to("/dead-letters/redrive"),
                fields: &[("id", &id), ("queue", &queue), ("reason", &reason)],
                yes: "Yes, redrive",
                no: &fallback,
            },
        );
    }
    let headers = return_headers(&headers, &f);
    let run = async {
        let mut tx = s.pool.begin().await?;
        let outcomes = s.outbox.redrive_dead_letters(&mut tx, &selection).await?;
        tx.commit().await?;
        Ok::<_, outbox::Error>(outcomes)
    };
    let outcome = match run.await {
        Err(e) => Outcome::Failed(e.to_string()),
        Ok(list) if list.is_empty() => {
            Outcome::Ok("no dead letter matched: nothing redriven".to_owned())
        }
        Ok(list) => {
            let done = list
                .iter()
                .filter(|o| matches!(o.result, RedriveResult::Redriven { .. }))
                .count();
            let undone: Vec<String> = list
                .iter()
                .filter(|o| {
                    !matches!(
                        o.result,
                        RedriveResult::Redriven { .. } | RedriveResult::AlreadyRedriven { .. }
                    )
                })
                .map(|o| format!("{}: {}", o.dead_letter_id, describe(o.result)))
                .collect();
            let text = list
                .iter()
                .map(|o| format!("dead letter {}: {}", o.dead_letter_id, describe(o.result)))
                .take(5)
                .collect::<Vec<_>>()
                .join("; ");
            if undone.is_empty() {
                Outcome::Ok(format!("redriven {done} of {}: {text}", list.len()))
            } else {
                Outcome::Failed(format!(
                    "redriven {done} of {}; not redriven: {}",
                    list.len(),
                    undone.join("; ")
                ))
            }
        }
    };
    back(&s, &base, &headers, &fallback, outcome)
}

fn describe(r: RedriveResult) -> String {
    match r {
        RedriveResult::Redriven { id } => format!("redriven as row {id}"),
        RedriveResult::AlreadyRedriven {
            redriven_id: Some(id),
        } => format!("already redriven (row {id})"),
        RedriveResult::AlreadyRedriven { redriven_id: None } => "already redriven".to_owned(),
        RedriveResult::NotFound => "no such dead letter".to_owned(),
        RedriveResult::TimerKeyHeld => {
            "kept: a live row holds its timer key (cancel or wait for it, then redrive)".to_owned()
        }
        RedriveResult::HeadersNotAMap => "kept: its stored headers are not a string map".to_owned(),
        RedriveResult::HeadersTooLarge { bytes } => format!(
            "kept: its headers with the redrive header would be {bytes} bytes, over the limit"
        ),
        other => format!("{other:?}"),
    }
}

/// Purges dead letters older than `older_than` (of `queue`, or all), as `outbox dlq purge`:
/// the first `POST` answers a confirmation page; the one it sends (`confirm=yes`) deletes.
pub(crate) async fn purge(
    State(s): State<Shared>,
    base: Base,
    headers: HeaderMap,
    Form(f): Form<Fields>,
) -> Response {
    if let Some(r) = refused(&s, &base, &headers, &f) {
        return r;
    }
    let fallback = base.to("/dead-letters");
    let text = f.older_than.as_deref().unwrap_or("").trim().to_owned();
    let age = match duration("age", &text) {
        Ok(d) => d,
        Err(e) => {
            return back(
                &s,
                &base,
                &headers,
                &fallback,
                Outcome::Failed(format!("bad age ({e}): e.g. 7d or 12h")),
            )
        }
    };
    // Byte-exact: the queue name as the library stores it (never trimmed).
    let queue = f
        .queue
        .as_deref()
        .filter(|q| !q.is_empty())
        .map(str::to_owned);
    if let Some(q) = &queue {
        if let Err(reason) = valid_name(q) {
            return back(
                &s,
                &base,
                &headers,
                &fallback,
                Outcome::Failed(format!("bad queue name: {reason}")),
            );
        }
    }
    let scope = match &queue {
        Some(q) => format!("of queue {q}"),
        None => "of every queue".to_owned(),
    };
    if f.confirm.as_deref() != Some("yes") {
        let body = html! {
            p { "Delete every dead letter " (scope) " that failed more than " (humantime::format_duration(age)) " ago, redriven or not? This cannot be undone." }
            form.inline method="post" action=(base.to("/dead-letters/purge")) {
                input type="hidden" name="csrf" value=(s.csrf);
                input type="hidden" name="older_than" value=(text);
                input type="hidden" name="queue" value=(queue.as_deref().unwrap_or(""));
                input type="hidden" name="confirm" value="yes";
                button.danger type="submit" { "Yes, purge" }
            }
            " "
            a href=(fallback) { "No, go back" }
        };
        return layout::page(
            &base,
            &s,
            "Purge dead letters?",
            "dead-letters",
            &Notice::default(),
            false,
            body,
        )
        .into_response();
    }
    let mut filter = DeadLetterFilter::new()
        .older_than(age)
        .include_redriven(true);
    if let Some(q) = &queue {
        filter = filter.queue(q);
    }
    let outcome = match s.outbox.purge_dead_letters(&s.pool, &filter, 1000).await {
        Ok(n) => Outcome::Ok(format!(
            "deleted {n} dead letter(s) {scope} older than {}",
            humantime::format_duration(age)
        )),
        Err(e) => Outcome::Failed(e.to_string()),
    };
    back(&s, &base, &HeaderMap::new(), &fallback, outcome)
}
