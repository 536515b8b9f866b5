//! `/schedules`: the periodic schedules, one row each (timer key `schedule:<name>`): their
//! recurrence, next instant and last run.

use std::time::Duration;

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use maud::html;

use crate::layout::{self, Base, Notice};
use crate::pages::queue::when;
use crate::sql::{self, ScheduleRow};
use crate::state::State as Shared;

/// At most this many schedules per queue are listed.
const PER_QUEUE: i64 = 500;

pub(crate) async fn page(
    State(s): State<Shared>,
    base: Base,
    Query(notice): Query<Notice>,
) -> Response {
    let read = async {
        let mut conn = s.pool.acquire().await?;
        let (rows, bytewise) = sql::schedules(&s.sql, &s.outbox, &mut conn, PER_QUEUE).await?;
        let now = sql::now(&s.outbox, &mut conn).await?;
        Ok::<_, sqlx::Error>((rows, bytewise, now))
    };
    let (rows, bytewise, now) = match read.await {
        Ok(r) => r,
        Err(e) => return layout::failed(&base, &s, &e),
    };
    let body = html! {
        p.muted {
            "A schedule is a keyed timer "
            code { (outbox::store::SCHEDULE_KEY_PREFIX) "<name>" }
            " of its queue; each run queues the next instant before it starts. Cancel its timer (on its row's page) to stop it; a worker that declares it registers it again."
            @if !bytewise {
                " This database's collation does not order text byte by byte: each queue's keyed timers are read to find them."
            }
        }
        @if rows.is_empty() {
            p { "No periodic schedule." }
        } @else {
            table {
                thead { tr {
                    th scope="col" { "Schedule" }
                    th scope="col" { "Queue" }
                    th scope="col" { "Recurrence" }
                    th scope="col" { "Next instant" }
                    th scope="col" { "Last run" }
                    th scope="col" { "State" }
                } }
                tbody {
                    @for r in &rows {
                        tr {
                            th scope="row" {
                                a href=(base.to(&format!("/rows/{}", r.id))) {
                                    (r.timer_id.strip_prefix(outbox::store::SCHEDULE_KEY_PREFIX).unwrap_or(&r.timer_id))
                                }
                            }
                            td { a href=(base.to(&layout::queue_path(&r.queue, None))) { (r.queue) } }
                            td { (recurrence(r.fingerprint.as_deref())) }
                            td { @match next(r) { Some(t) => (when(t, now)), None => "–" } }
                            td { @match r.last_attempt_at { Some(t) => (when(t, now)), None => "never" } }
                            td { (state(r)) }
                        }
                    }
                }
            }
        }
    };
    layout::page(
        &base,
        &s,
        "Periodic schedules",
        "schedules",
        &notice,
        false,
        body,
    )
    .into_response()
}

/// The next instant: the pending row's deadline, or while it runs, the instant its run
/// queued as a rearm.
fn next(r: &ScheduleRow) -> Option<chrono::DateTime<chrono::Utc>> {
    match r.acquired_at {
        None => Some(r.next_attempt_at),
        Some(_) => r.rearm_at,
    }
}

fn state(r: &ScheduleRow) -> String {
    match (r.acquired_at.is_some(), r.cancelled_at.is_some()) {
        (true, true) => "running, cancelled: it stops after this run".to_owned(),
        (true, false) => "running".to_owned(),
        (false, _) if r.attempts > 0 => format!("waiting to retry (attempt {})", r.attempts),
        (false, _) => "waiting".to_owned(),
    }
}

/// A fingerprint (`every:<n>s`, `every:<n>us`, `cron:<expression>@<zone>`) in words.
pub(crate) fn recurrence(fingerprint: Option<&str>) -> String {
    let Some(f) = fingerprint else {
        return "– (no fingerprint header)".to_owned();
    };
    if let Some(every) = f.strip_prefix("every:") {
        let d = if let Some(us) = every.strip_suffix("us") {
            us.parse().ok().map(Duration::from_micros)
        } else {
            every
                .strip_suffix('s')
                .and_then(|s| s.parse().ok())
                .map(Duration::from_secs)
        };
        if let Some(d) = d {
            return format!("every {}", humantime::format_duration(d));
        }
    }
    if let Some(cron) = f.strip_prefix("cron:") {
        if let Some((expr, zone)) = cron.rsplit_once('@') {
            return format!("cron {expr} ({zone})");
        }
    }
    f.to_owned()
}

#[cfg(test)]
mod tests {
    use super::recurrence;

    #[test]
    fn fingerprints_in_words() {
        assert_eq!(recurrence(Some("every:300s")), "every 5m");
        assert_eq!(recurrence(Some("every:1500us")), "every 1ms 500us");
        assert_eq!(
            recurrence(Some("cron:0 3 * * *@Europe/Paris")),
            "cron 0 3 * * * (Europe/Paris)"
        );
        assert_eq!(recurrence(Some("odd")), "odd");
        assert_eq!(recurrence(None), "– (no fingerprint header)");
    }
}
