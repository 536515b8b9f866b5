//! `/`: every queue's figures, a sparkline of its live rows, pause and resume.

use std::collections::BTreeMap;

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use maud::html;
use outbox::stats::{Count, QueueStats, StatsMode, StatsRequest};

use crate::format;
use crate::history::{percentile, Sample};
use crate::layout::{self, encode, Base, Notice};
use crate::limits::{DUE_COUNT_CAP, EXACT_STATS_MAX_BYTES};
use crate::sql;
use crate::state::State as Shared;

pub(crate) async fn page(
    State(s): State<Shared>,
    base: Base,
    Query(notice): Query<Notice>,
) -> Response {
    match read(&s).await {
        Ok(view) => render(&s, &base, &notice, view).into_response(),
        Err(e) => layout::failed(&base, &s, &e),
    }
}

struct View {
    stats: Vec<QueueStats>,
    due: BTreeMap<String, i64>,
    paused: BTreeMap<String, chrono::DateTime<chrono::Utc>>,
    mode: StatsMode,
    now: chrono::DateTime<chrono::Utc>,
    throughput: Option<f64>,
    /// Per queue, from the counter, when it is installed.
    rates: Option<crate::throughput::Rates>,
    history: BTreeMap<String, Vec<Sample>>,
}

async fn read(s: &Shared) -> Result<View, outbox::Error> {
    let mut conn = s.pool.acquire().await?;
    let sizes = sql::sizes(&s.sql, &s.outbox, &mut conn).await?;
    let mode = if sizes.queue_bytes <= EXACT_STATS_MAX_BYTES
        && sizes.dead_letter_bytes <= EXACT_STATS_MAX_BYTES
    {
        StatsMode::Exact
    } else {
        StatsMode::Estimate
    };
    let request = StatsRequest::new(s.lease_ttl).mode(mode);
    let stats = s.outbox.stats(&mut conn, &request).await?;
    let paused: BTreeMap<_, _> = s
        .outbox
        .paused_queues(&mut conn)
        .await?
        .into_iter()
        .map(|p| (p.queue, p.paused_at))
        .collect();
    let rates = crate::throughput::read(&s.outbox, &mut conn).await?;
    let names: Vec<String> = stats.iter().map(|q| q.queue.clone()).collect();
    // Exact mode counts due rows itself; the estimate cannot, so count them up to the cap.
    let due = if mode == StatsMode::Estimate && !names.is_empty() {
        sql::due(&s.sql, &s.outbox, &mut conn, &names, DUE_COUNT_CAP + 1)
            .await?
            .into_iter()
            .collect()
    } else {
        BTreeMap::new()
    };
    let samples: Vec<(String, Sample)> = stats
        .iter()
        .map(|q| {
            let live = match (q.pending.value(), q.leased.value()) {
                (Some(p), Some(l)) => Some(p + l),
                _ => None,
            };
            let lateness = q.oldest_due_lateness.map_or(0.0, |d| d.as_secs_f64());
            (
                q.queue.clone(),
                Sample {
                    at: sizes.now,
                    live,
                    lateness,
                },
            )
        })
        .collect();
    let mut h = s.history.lock().unwrap_or_else(|p| p.into_inner());
    h.record(sizes.now, &samples, sizes.finished);
    let history = names.iter().map(|n| (n.clone(), h.of(n))).collect();
    let throughput = h.throughput();
    drop(h);
    Ok(View {
        stats,
        due,
        paused,
        mode,
        now: sizes.now,
        throughput,
        rates,
        history,
    })
}

fn due(view: &View, q: &QueueStats) -> String {
    match view.due.get(&q.queue) {
        Some(&n) if n > DUE_COUNT_CAP => format!("more than {DUE_COUNT_CAP}"),
        Some(&n) => n.to_string(),
        None => format::count(q.due),
    }
}

fn render(s: &Shared, base: &Base, notice: &Notice, view: View) -> maud::Markup {
    // Queues without a live row or a dead letter that are paused, or finished rows in
    // the counter's window: shown too (a queue whose rows were all acked has a rate).
    let mut quiet: std::collections::BTreeSet<&String> = view.paused.keys().collect();
    if let Some(r) = &view.rates {
        quiet.extend(r.per_minute.keys());
    }
    quiet.retain(|q| !view.stats.iter().any(|st| &st.queue == *q));
    let body = html! {
        p.muted {
            "As of " time datetime=(view.now.to_rfc3339()) { (format::utc(view.now)) } ". "
            @match view.mode {
                StatsMode::Exact => "Counts are exact. ",
                _ => "Pending rows and dead letters are estimates (≈) from the planner's statistics: the tables are large. ",
            }
            @match &view.rates {
                Some(r) => {
                    "Finished per second: each queue's rows acked, failed, cancelled or deleted over the last "
                    (crate::throughput::WINDOW_MINUTES) " minutes, or since the counter was installed when that is shorter (the counter table " code { (crate::throughput::Names::of(&s.outbox).table) } "). "
                    @if let Some(at) = r.installed() {
                        "Counting since " (format::utc(at)) @if view.now - at < crate::throughput::Rates::FIRST { " (no rate until it has counted a full minute)" } ". "
                    }
                }
                None => {
                    "Rows finished: "
                    @match view.throughput {
                        Some(t) => { (format!("{t:.1}")) "/s" }
                        None => "– (needs two samples)",
                    }
                    " (all queues, over the samples of the last 10 min; per queue needs the throughput counter: "
                    code { "outbox ui --throughput-counter" } " or " code { "Dashboard::install_throughput_counter" } "). "
                }
            }
            noscript { a href=(base.to("/")) { "Refresh" } }
        }
        @if view.stats.is_empty() && quiet.is_empty() {
            p { "No queue has a live row or a dead letter." }
        } @else {
            table {
                caption.muted { "Lateness: how late the oldest due row is now, and its 50th and 99th percentile over the samples of the last 10 minutes (taken while this page is open). Trend: live rows over the same samples." }
                thead {
                    tr {
                        th scope="col" { "Queue" }
                        th.num scope="col" { "Pending" }
                        th.num scope="col" { "Due" }
                        th.num scope="col" { "Leased" }
                        th.num scope="col" { "Expired leases" }
                        th.num scope="col" { "Lateness now" }
                        th.num scope="col" { "p50 / p99" }
                        th.num scope="col" { "Rearms" }
                        th.num scope="col" { "Dead letters" }
                        th.num scope="col" { "Finished/s" }
                        th scope="col" { "Trend" }
                        th scope="col" { "State" }
                    }
                }
                tbody {
                    @for q in &view.stats {
                        @let samples = view.history.get(&q.queue).cloned().unwrap_or_default();
                        @let late: Vec<f64> = samples.iter().map(|x| x.lateness).collect();
                        @let series: Vec<Option<f64>> = samples.iter().map(|x| x.live.map(|v| v as f64)).collect();
                        @let url = base.to(&layout::queue_path(&q.queue, None));
                        tr {
                            th scope="row" { a href=(url) { (q.queue) } }
                            td.num { (format::count(q.pending)) }
                            td.num { (due(&view, q)) }
                            td.num { (format::count(q.leased)) }
                            td.num { (format::count(q.expired_leases)) }
                            td.num { (q.oldest_due_lateness.map_or("–".to_owned(), |d| format::seconds(d.as_secs_f64()))) }
                            td.num {
                                (percentile(&late, 0.5).map_or("–".to_owned(), format::seconds))
                                " / "
                                (percentile(&late, 0.99).map_or("–".to_owned(), format::seconds))
                            }
                            td.num { (format::count(q.rearms)) }
                            td.num {
                                @if matches!(q.dead_letters, Count::Unavailable) {
                                    "–"
                                } @else {
                                    a href=(base.to(&format!("/dead-letters?queue={}", encode(&q.queue)))) { (format::count(q.dead_letters)) }
                                }
                            }
                            td.num.throughput {
                                @match &view.rates {
                                    Some(r) => {
                                        (rate(r, &q.queue))
                                        " " (format::sparkline(&r.minutes(&q.queue), &format!("rows of {} finished per minute", q.queue)))
                                    }
                                    None => "–",
                                }
                            }
                            td { (format::sparkline(&series, &format!("live rows of {}", q.queue))) }
                            td { (state(s, base, &q.queue, view.paused.get(&q.queue).copied(), view.now)) }
                        }
                    }
                    @for queue in &quiet {
                        tr {
                            th scope="row" { a href=(base.to(&layout::queue_path(queue, None))) { (queue) } }
                            td.num colspan="8" { span.muted { "no live row, no dead letter" } }
                            td.num.throughput {
                                @if let Some(r) = &view.rates {
                                    (rate(r, queue))
                                }
                            }
                            td {}
                            td { (state(s, base, queue, view.paused.get(*queue).copied(), view.now)) }
                        }
                    }
                }
            }
        }
    };
    layout::page(base, s, "Queues", "queues", notice, true, body)
}

/// "running" or "paused 3 min ago", and the button that changes it.
pub(crate) fn state(
    s: &Shared,
    base: &Base,
    queue: &str,
    paused_at: Option<chrono::DateTime<chrono::Utc>>,
    now: chrono::DateTime<chrono::Utc>,
) -> maud::Markup {
    let path = |what: &str| base.to(&layout::queue_path(queue, Some(what)));
    html! {
        @match paused_at {
            Some(at) => {
                span.paused title=(format::utc(at)) { "paused " (format::relative(at, now)) }
                " "
                (layout::button(s, &path("resume"), &[], &format!("Resume {queue}"), ""))
            }
            None => {
                span { "running" }
                " "
                (layout::button(s, &path("pause"), &[], &format!("Pause {queue}"), ""))
            }
        }
    }
}

/// A queue's rate from the counter, or "–" while the counter is too new to tell.
fn rate(r: &crate::throughput::Rates, queue: &str) -> String {
    r.per_second(queue)
        .map_or_else(|| "–".to_owned(), |v| format!("{v:.2}"))
}
