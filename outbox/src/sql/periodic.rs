//! Periodic timers: the start-of-run arming of a schedule's next instant, and the
//! registration of a schedule (insert its row, or bring a stored one up to a changed
//! schedule). A schedule is a keyed timer with a reserved `schedule:<name>` key; its
//! fingerprint travels in the row's headers under [`SCHEDULE_HEADER`].

use sqlx::SqlStr;

use super::publish::bucket_columns;
use super::text::{in_bucket, notify, query, wake};
use crate::names::Names;

/// The header that holds a schedule's fingerprint. A literal of our own, pasted into the
/// statements as a JSON key (it holds no quote).
pub(crate) const SCHEDULE_HEADER: &str = "outbox-schedule";

/// The prefix of every schedule's timer key (a reserved key space: publishes refuse it).
pub(crate) const SCHEDULE_KEY_PREFIX: &str = "schedule:";

#[derive(Debug)]
pub(crate) struct Periodic {
    /// Queues the next instant on a running periodic row: `$1` id, `$2` token, `$3` next
    /// instant (distributed mode: `$4` the row's bucket) → `(rows locked, cancelled, rearm
    /// deadline now stored, written)`.
    pub arm_next: SqlStr,
    /// Registers a schedule: `$1` queue, `$2` timer id, `$3` payload, `$4` headers, `$5`
    /// first instant (distributed mode: `$6` the key's bucket) → one row `(id, inserted,
    /// leased, deadline or rearm deadline, notify)` when something was written, none when
    /// the stored schedule is the same.
    pub register: SqlStr,
    /// Distributed mode: `register` rewrites the key's row only, one row per row found
    /// (its id NULL when nothing changed); this inserts the schedule when it found none,
    /// same parameters → `(id, true, false, deadline, notify)`, none when another
    /// registration inserted it first.
    pub register_insert: Option<SqlStr>,
    /// Sends the wake-up payloads its statements return, distributed mode only
    /// (`text::wake`).
    pub wake: Option<SqlStr>,
}

impl Periodic {
    pub(crate) fn render(n: &Names) -> Self {
        let t = &n.qtable;
        let h = SCHEDULE_HEADER;
        // SPEC §9.1: at the start of a run, the next instant as a rearm, fenced by the token
        // and `cancelled_at IS NULL` (it never clears a cancel mark: a cancel stops the
        // schedule). The primary key finds the row; `IS NOT DISTINCT FROM` keeps the planner
        // on it (see complete.rs). It locks the row first and decides under the lock, reading
        // every value another transaction may change from the locking CTE (complete.rs,
        // APPLY_REARM): an extend or a registration that committed while we waited is seen.
        // A rearm already queued stays when
        // - it is not earlier than the next instant (a reclaim after a crash finds the one
        //   the crashed run queued; a user's extend to a later deadline): later only, as an
        //   extend, so two runs of one instant arm the same next instant once;
        // - or it carries another schedule's fingerprint than the running row: a registration
        //   of a changed schedule replaced it, and the new schedule wins, earlier or not.
        // Otherwise (an earlier rearm of this schedule, or one without a fingerprint) the
        // next instant replaces it, with the row's own payload and headers. A cancel racing
        // this statement is ordered by the row lock: first, and we write nothing; after, and
        // it drops what we queued and marks the row.
        let arm_next = format!(
            r#"
WITH cur AS (
    SELECT id, payload, headers, rearm_at, cancelled_at IS NOT NULL AS cancelled,
           rearm_at IS NOT NULL
             AND (rearm_at >= $3::timestamptz
                  OR (rearm_headers->>'{h}' IS NOT NULL
                      AND rearm_headers->>'{h}' IS DISTINCT FROM headers->>'{h}')) AS keep
    FROM {t} WHERE id = $1 AND acquired_token IS NOT DISTINCT FROM $2{b4} FOR UPDATE),
armed AS (
    UPDATE {t} t SET rearm_at = $3::timestamptz, rearm_payload = cur.payload,
                     rearm_headers = cur.headers
    FROM cur WHERE t.id = $1 AND t.id = cur.id AND NOT cur.cancelled AND NOT cur.keep{tb4}
    RETURNING t.rearm_at)
SELECT (SELECT count(*) FROM cur), (SELECT bool_or(cancelled) FROM cur),
       coalesce((SELECT rearm_at FROM armed),
                (SELECT rearm_at FROM cur WHERE NOT cancelled)),
       (SELECT count(*) FROM armed) > 0"#,
            b4 = in_bucket(n, "", 4),
            tb4 = in_bucket(n, "t.", 4),
        );
        // SPEC §9.1: registration in one statement, on the partial unique index
        // `<t>_timer_id_uq` `(queue, timer_id) WHERE timer_id IS NOT NULL`. Two workers
        // registering at once: the second's insert waits for the first's to commit, then
        // takes the DO UPDATE branch and finds the same schedule, so one live row. A
        // registration racing a claim waits on the claim's row lock and then sees the leased
        // row (as an extend does, SPEC §5.3); one racing a completion that deletes the row
        // inserts it again (ON CONFLICT retries the insert once the conflicting row is gone).
        // What is compared is what the row carries next: a queued rearm's fingerprint and
        // payload when there is one, else the row's. The same fingerprint and payload write
        // nothing (a failed DO UPDATE WHERE only locks the row) unless a cancel stopped the
        // schedule on a running row (mark set, no rearm): "a cancel stops the schedule until
        // the next registration", so that registration queues the first instant as a rearm
        // and clears the mark (the newest intent wins, as an extend, SPEC §3); a cancelled
        // pending row was deleted, and the insert brings it back.
        // - Another fingerprint (a changed recurrence) moves a pending row to the new first
        //   instant (earlier allowed, unlike an extend) with the new payload and headers, or
        //   replaces the rearm queued on a leased row (earlier allowed). A pending row that is
        //   already overdue keeps its deadline (the payload and headers still change): the
        //   missed instant fires once, at once, as missed instants do, and its run arms the
        //   next instant on the new recurrence.
        // - The same fingerprint with another payload (the code's payload changed) replaces
        //   the payload and keeps the timing: a pending row keeps its deadline, a leased
        //   row's queued rearm keeps its deadline (a leased row without one gets the first
        //   instant, as after a cancel). So a payload whose encoding varies between starts
        //   (a map's order) costs a write per start, never a moved deadline.
        // Any write to a pending row resets its retry history, as an extend does. `xmax = 0`
        // marks a fresh insert. An insert or a rewritten pending row notifies (it may be due
        // earlier than any worker's wake-up); a queued rearm does not: its completion
        // notifies when it applies.
        let pending = "t.acquired_token IS NULL";
        let next_fp = format!(
            "(CASE WHEN t.rearm_at IS NOT NULL THEN t.rearm_headers ELSE t.headers END)->>'{h}'"
        );
        let moved = format!("({next_fp} IS DISTINCT FROM excluded.headers->>'{h}')");
        let next_payload =
            "(CASE WHEN t.rearm_at IS NOT NULL THEN t.rearm_payload ELSE t.payload END)";
        let set = format!(
            r#"next_attempt_at  = CASE WHEN {pending} AND {moved} AND t.next_attempt_at > now()
                                THEN excluded.next_attempt_at ELSE t.next_attempt_at END,
        payload          = CASE WHEN {pending} THEN excluded.payload ELSE t.payload END,
        headers          = CASE WHEN {pending} THEN excluded.headers ELSE t.headers END,
        attempts_count   = CASE WHEN {pending} THEN 0 ELSE t.attempts_count END,
        first_attempt_at = CASE WHEN {pending} THEN NULL ELSE t.first_attempt_at END,
        last_attempt_at  = CASE WHEN {pending} THEN NULL ELSE t.last_attempt_at END,
        rearm_at         = CASE WHEN {pending} THEN t.rearm_at
                                WHEN {moved} OR t.rearm_at IS NULL THEN excluded.next_attempt_at
                                ELSE t.rearm_at END,
        rearm_payload    = CASE WHEN {pending} THEN t.rearm_payload ELSE excluded.payload END,
        rearm_headers    = CASE WHEN {pending} THEN t.rearm_headers ELSE excluded.headers END,
        cancelled_at     = NULL"#
        );
        let changed = format!(
            "{moved}
       OR {next_payload} IS DISTINCT FROM excluded.payload
       OR (t.cancelled_at IS NOT NULL AND t.rearm_at IS NULL)"
        );
        // A stored schedule consumes no identity value (issue 27; every worker start
        // registers): lock the key's row, rewrite it when something changed, insert only
        // when no row was found, with ON CONFLICT … DO UPDATE as the guard for a row
        // inserted after the snapshot. Registration runs once per worker start, so it keeps
        // the lock before the write that `publish.extend`, a hot path, drops (sql/publish.rs).
        let register = format!(
            r#"
WITH v AS (
    SELECT $1::text AS queue, $3::bytea AS payload, $4::jsonb AS headers,
           $5::timestamptz AS next_attempt_at, $2::text AS timer_id),
cur AS (
    SELECT id FROM {t} WHERE queue = $1::text AND timer_id = $2::text FOR UPDATE),
upd AS (
    UPDATE {t} AS t SET
        {set}
    FROM cur, v AS excluded
    WHERE t.queue = $1::text AND t.timer_id = $2::text AND t.id = cur.id
      AND ({changed})
    RETURNING t.id, t.queue, t.next_attempt_at, t.rearm_at, false AS inserted,
              (t.acquired_token IS NOT NULL) AS leased),
ins AS (
    INSERT INTO {t} AS t (queue, payload, headers, next_attempt_at, timer_id)
    SELECT queue, payload, headers, next_attempt_at, timer_id FROM v
    WHERE NOT EXISTS (SELECT FROM cur)
    ON CONFLICT (queue, timer_id) WHERE timer_id IS NOT NULL DO UPDATE SET
        {set}
    WHERE {changed}
    RETURNING t.id, t.queue, t.next_attempt_at, t.rearm_at, (t.xmax = 0) AS inserted,
              (t.acquired_token IS NOT NULL) AS leased),
up AS (
    SELECT * FROM upd UNION ALL SELECT * FROM ins)
SELECT up.id, up.inserted, up.leased,
       CASE WHEN up.leased THEN up.rearm_at ELSE up.next_attempt_at END,
       CASE WHEN NOT up.leased THEN {notify} END
FROM up"#,
            notify = notify(n, "up"),
        );
        // Distributed mode (Citus): the two single-shard steps of a distributed keyed
        // publish (sql/publish.rs): `register` locks and rewrites the key's row (one row
        // per row found, its id NULL when the stored schedule is the same), and only when
        // it found none `register_insert` inserts with `ON CONFLICT … DO NOTHING`; `$6` is
        // the key's bucket in both.
        let (register, register_insert) = match n.buckets {
            None => (register, None),
            Some(_) => {
                // `now()` comes from `cur`: Citus refuses a function that is not
                // IMMUTABLE inside CASE or COALESCE of an UPDATE (sql/publish.rs).
                let proposed = |text: &str| {
                    text.replace("excluded.next_attempt_at", "$5::timestamptz")
                        .replace("excluded.payload", "$3::bytea")
                        .replace("excluded.headers", "$4::jsonb")
                        .replace("now()", "cur.now")
                };
                let update = format!(
                    r#"
WITH cur AS (
    SELECT id, now() AS now
    FROM {t} WHERE queue = $1::text AND timer_id = $2::text{b6} FOR UPDATE),
upd AS (
    UPDATE {t} AS t SET
        {set}
    FROM cur
    WHERE t.queue = $1::text AND t.timer_id = $2::text AND t.id = cur.id{tb6}
      AND ({changed})
    RETURNING t.id, t.queue, t.next_attempt_at, t.rearm_at,
              (t.acquired_token IS NOT NULL) AS leased)
SELECT upd.id, false, upd.leased,
       CASE WHEN upd.leased THEN upd.rearm_at ELSE upd.next_attempt_at END,
       CASE WHEN NOT upd.leased THEN {notify} END
FROM cur LEFT JOIN upd ON upd.id = cur.id"#,
                    set = proposed(&set),
                    changed = proposed(&changed),
                    notify = notify(n, "upd"),
                    b6 = in_bucket(n, "", 6),
                    tb6 = in_bucket(n, "t.", 6),
                );
                let (bc, bv) = bucket_columns(n, 6);
                let insert = format!(
                    r#"
WITH ins AS (
    INSERT INTO {t} ({bc}queue, payload, headers, next_attempt_at, timer_id)
    VALUES ({bv}$1::text, $3::bytea, $4::jsonb, $5::timestamptz, $2::text)
    ON CONFLICT (bucket, queue, timer_id) WHERE timer_id IS NOT NULL DO NOTHING
    RETURNING id, queue, next_attempt_at)
SELECT ins.id, true, false, ins.next_attempt_at, {notify} FROM ins"#,
                    notify = notify(n, "ins"),
                );
                (update, Some(query(insert)))
            }
        };
        Periodic {
            wake: wake(n),
            register_insert,
            arm_next: query(arm_next),
            register: query(register),
        }
    }

    #[cfg(any(test, feature = "testing"))]
    pub(super) fn all(&self) -> Vec<(&'static str, &str)> {
        vec![
            ("periodic.arm_next", self.arm_next.as_str()),
            ("periodic.register", self.register.as_str()),
        ]
    }
}
