//! The metrics of SPEC §11 move.
//!
//! Each test records into a recorder of its own thread (`metrics::set_default_local_recorder`):
//! `#[tokio::test]` runs the worker's tasks on that thread too, and tests running beside it
//! record elsewhere. The runtime describes its metrics once per process, to the recorder of
//! that moment, so the test of units and descriptions also needs the process to itself.

use sqlx::AssertSqlSafe;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use metrics_util::MetricKind;
use outbox::{Context, HandlerOptions, Outcome, RetryStrategy, Worker};
use outbox_tests::Fixture;

#[outbox::timer(queue = "metered", max_deliveries = 5)]
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Metered {
    kind: String,
}

/// Adds to `out` the counters and histogram sample counts taken since the last read (a
/// snapshot drains them), by name and sorted labels.
fn read_into(s: &Snapshotter, out: &mut HashMap<String, f64>) {
    for (key, _, _, value) in s.snapshot().into_vec() {
        let mut labels: Vec<String> = key
            .key()
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        let name = format!("{}{{{}}}", key.key().name(), labels.join(","));
        let v = match (key.kind(), value) {
            (MetricKind::Counter, DebugValue::Counter(c)) => c as f64,
            (MetricKind::Histogram, DebugValue::Histogram(h)) => h.len() as f64,
            (_, DebugValue::Gauge(g)) => g.into_inner(),
            _ => 0.0,
        };
        *out.entry(name).or_insert(0.0) += v;
    }
}

#[tokio::test]
async fn counters_and_histograms_move() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);

    let f = Fixture::new().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = {
        let (runs, pool, outbox) = (runs.clone(), f.pool.clone(), f.outbox.clone());
        Worker::builder(f.store.clone())
            .idle_poll(Duration::from_millis(100))
            .timer_with::<Metered>(
                move |m: Metered, ctx: Context| {
                    let (runs, pool, outbox) = (runs.clone(), pool.clone(), outbox.clone());
                    async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        match (m.kind.as_str(), ctx.attempt()) {
                            ("fail-once", 1) => Err("first run fails".to_owned()),
                            ("reject", _) => Ok(Outcome::Reject("no".into())),
                            ("rearm", _) => {
                                let mut conn = pool.acquire().await.map_err(|e| e.to_string())?;
                                let next = Metered { kind: "plain".into() };
                                extend_metered(&mut outbox.on(&mut conn), "rearm", &next, Duration::from_millis(50))
                                    .await
                                    .map_err(|e| e.to_string())?;
                                Ok(Outcome::Ack)
                            }
                            ("steal", _) => {
                                // Another worker "reclaims" the row under our feet.
                                let sql = format!("UPDATE {} SET acquired_token = gen_random_uuid() WHERE id = $1", outbox.table());
                                sqlx::query(AssertSqlSafe(&*sql)).bind(ctx.id()).execute(&pool).await.map_err(|e| e.to_string())?;
                                Ok(Outcome::Ack)
                            }
                            _ => Ok(Outcome::Ack),
                        }
                    }
                },
                HandlerOptions::new().retry(RetryStrategy::constant(Duration::from_millis(20))),
            )
            .build()
            .unwrap()
            .start()
    };
    let mut conn = f.pool.acquire().await.unwrap();
    for kind in ["plain", "fail-once", "reject", "rearm", "steal"] {
        publish_metered(
            &mut f.outbox.on(&mut conn),
            kind,
            &Metered { kind: kind.into() },
            Duration::ZERO,
        )
        .await
        .unwrap();
    }
    let end = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut m = HashMap::new();
    loop {
        read_into(&snapshotter, &mut m);
        let acked = m
            .get("outbox_acked_total{queue=metered}")
            .copied()
            .unwrap_or(0.0);
        let lost = m
            .get("outbox_lease_lost_total{phase=ack,queue=metered}")
            .copied()
            .unwrap_or(0.0);
        if acked >= 4.0 && lost >= 1.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "metrics never arrived: {m:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    worker.shutdown().await;
    read_into(&snapshotter, &mut m);
    let get = |k: &str| m.get(k).copied().unwrap_or(0.0);
    assert_eq!(
        get("outbox_published_total{queue=metered}"),
        5.0,
        "the extend queued a rearm, no insert: {m:#?}"
    );
    // plain, fail-once (2nd run), rearm, and the rearmed instance: four successes.
    assert_eq!(get("outbox_acked_total{queue=metered}"), 4.0, "{m:#?}");
    assert_eq!(get("outbox_retried_total{queue=metered}"), 1.0, "{m:#?}");
    assert_eq!(
        get("outbox_terminal_total{queue=metered,reason=rejected}"),
        1.0,
        "{m:#?}"
    );
    assert_eq!(
        get("outbox_dlq_written_total{queue=metered}"),
        1.0,
        "{m:#?}"
    );
    assert_eq!(get("outbox_rearmed_total{queue=metered}"), 1.0, "{m:#?}");
    assert_eq!(
        get("outbox_lease_lost_total{phase=ack,queue=metered}"),
        1.0,
        "{m:#?}"
    );
    assert!(
        get("outbox_handler_duration_seconds{queue=metered}") >= 7.0,
        "{m:#?}"
    );
    assert!(
        get("outbox_firing_lateness_seconds{queue=metered}") >= 7.0,
        "{m:#?}"
    );
    assert!(get("outbox_claim_batch_size{}") >= 1.0, "{m:#?}");
    f.cleanup().await;
}

/// Every metric carries its unit and a description (what an exporter shows as `# HELP`), and
/// `outbox_published_total` says it counts inserts inside the caller's transaction, not
/// commits. The descriptions reach the recorder set when the process's first worker or
/// publish describes the metrics: this test's, in a process of its own.
#[tokio::test]
async fn every_metric_has_a_unit_and_a_description() {
    crate::own_process();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);

    let f = Fixture::new().await;
    let worker = Worker::builder(f.store.clone())
        .idle_poll(Duration::from_millis(100))
        .timer::<Metered>(|_m: Metered, _ctx: Context| async {})
        .build()
        .unwrap()
        .start();
    let mut conn = f.pool.acquire().await.unwrap();
    publish_metered(
        f.outbox.on(&mut conn),
        "m",
        &Metered { kind: "ok".into() },
        Duration::ZERO,
    )
    .await
    .unwrap();
    outbox_tests::eventually(10, "the message is acked", || async {
        f.rows("metered").await.is_empty()
    })
    .await;
    worker.shutdown().await;

    let mut seen = 0;
    for (key, unit, description, _) in snapshotter.snapshot().into_vec() {
        let name = key.key().name().to_owned();
        if !name.starts_with("outbox_") {
            continue;
        }
        seen += 1;
        let want = if name.ends_with("_seconds") {
            metrics::Unit::Seconds
        } else {
            metrics::Unit::Count
        };
        assert_eq!(unit, Some(want), "{name}");
        let description = description.unwrap_or_else(|| panic!("{name} has no description"));
        if name == "outbox_published_total" {
            assert!(description.contains("rolled-back"), "{description}");
        }
    }
    assert!(
        seen >= 5,
        "published, acked, lateness, duration, batch size at least: {seen}"
    );
    f.cleanup().await;
}

/// `outbox_in_flight{queue}` counts handler runs in progress and comes back to zero on
/// every way a run ends: success, error, panic, timeout, and a run stopped at shutdown.
#[tokio::test]
async fn in_flight_counts_runs_and_comes_back_to_zero_on_every_path() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);

    let f = Fixture::new().await;
    let (main, hang) = ("inflight", "inflight.hang");
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let handler = {
        let release = release.clone();
        move |payload: Vec<u8>, _ctx: Context| {
            let release = release.clone();
            async move {
                match &payload[..] {
                    b"hold" => {
                        let _permit = release.acquire().await.map_err(|e| e.to_string())?;
                        Ok(Outcome::Ack)
                    }
                    b"error" => Err("fails".to_owned()),
                    b"panic" => panic!("handler panics"),
                    // Past the queue's timeout (200 ms), or forever on the queue without one.
                    b"sleep" => {
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                        Ok(Outcome::Ack)
                    }
                    _ => Ok(Outcome::Ack),
                }
            }
        }
    };
    let once = RetryStrategy::constant(Duration::from_millis(10)).max_attempts(1);
    let worker = Worker::builder(f.store.clone())
        .idle_poll(Duration::from_millis(50))
        .concurrency(4)
        .graceful_timeout(Duration::from_millis(100))
        .queue_with(
            main,
            handler.clone(),
            HandlerOptions::new()
                .retry(once)
                .timeout(Duration::from_millis(200)),
        )
        .queue_with(hang, handler, HandlerOptions::new().retry(once))
        .build()
        .unwrap()
        .start();
    let mut m = HashMap::new();
    let key = |q: &str| format!("outbox_in_flight{{queue={q}}}");
    let publish = |queue: &'static str, payload: &'static [u8]| {
        let (pool, outbox) = (f.pool.clone(), f.outbox.clone());
        async move {
            let mut conn = pool.acquire().await.unwrap();
            outbox
                .publish(&mut conn, outbox::Message::new(queue, payload))
                .await
                .unwrap();
        }
    };

    // Two runs held open: the gauge shows both.
    publish(main, b"hold").await;
    publish(main, b"hold").await;
    let end = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        read_into(&snapshotter, &mut m);
        if m.get(&key(main)).copied() == Some(2.0) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "two runs never showed: {m:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    release.add_permits(2);
    // An error, a panic and a timeout, each ending for good (one attempt).
    for payload in [&b"error"[..], b"panic", b"sleep"] {
        publish(main, payload).await;
    }
    outbox_tests::eventually(20, "every run of the main queue ended", || async {
        f.rows(main).await.is_empty()
    })
    .await;
    read_into(&snapshotter, &mut m);
    assert_eq!(m.get(&key(main)).copied(), Some(0.0), "{m:#?}");
    let letters = f
        .store
        .dead_letters(&outbox::dlq::DeadLetterFilter::new().queue(main), None, 10)
        .await
        .unwrap();
    let mut reasons: Vec<String> = letters.iter().map(|d| d.failure_reason.clone()).collect();
    reasons.sort();
    assert_eq!(
        reasons,
        ["retry_exhausted", "retry_exhausted", "timeout"],
        "the error, the panic and the timeout ran and ended: {letters:#?}"
    );

    // A run still going at shutdown is stopped (its future dropped): it comes back down.
    publish(hang, b"sleep").await;
    let end = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        read_into(&snapshotter, &mut m);
        if m.get(&key(hang)).copied() == Some(1.0) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "the hanging run never showed: {m:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let report = worker.shutdown().await;
    assert_eq!(report.abandoned, 1, "{report:?}");
    read_into(&snapshotter, &mut m);
    assert_eq!(m.get(&key(hang)).copied(), Some(0.0), "{m:#?}");
    assert_eq!(m.get(&key(main)).copied(), Some(0.0), "{m:#?}");
    f.cleanup().await;
}
