//! The spans of one message through OpenTelemetry (feature `opentelemetry`, on for this
//! crate): names and attributes by the messaging conventions, the span tree of publish →
//! claim → process → settle, the trace context written into the row's headers at publish
//! and the link it gives the delivery, and the header limit.
//!
//! Each test sets its own subscriber (a `tracing-opentelemetry` layer over an in-memory
//! exporter) as the default of its thread: `#[tokio::test]` runs on one thread, so the
//! worker's tasks record into it too, and tests running beside it do not. Which span sites
//! are enabled is cached for the whole process, though, and a test on another thread that
//! hits them first without a subscriber can leave one of this test's spans unrecorded: each
//! test that reads spans needs a process of its own.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceContextExt as _, TraceFlags, TraceId, TraceState,
    TracerProvider as _,
};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use outbox::message::{BatchItem, Headers, MAX_HEADERS_BYTES};
use outbox::telemetry::{TRACEPARENT_HEADER, TRACESTATE_HEADER};
use outbox::testing::MemoryStore;
use outbox::{Context, HandlerOptions, Message, Outcome, Publisher, RetryStrategy, Worker};
use outbox_tests::{eventually, Fixture};
use tracing::subscriber::DefaultGuard;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::layer::SubscriberExt;

/// An in-memory exporter behind a `tracing-opentelemetry` layer, the default subscriber of
/// this thread until the guard drops.
struct Traces {
    exporter: InMemorySpanExporter,
    provider: SdkTracerProvider,
    _guard: DefaultGuard,
}

impl Traces {
    fn install() -> Traces {
        crate::own_process();
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-tests"));
        let guard = tracing::subscriber::set_default(tracing_subscriber::registry().with(layer));
        Traces {
            exporter,
            provider,
            _guard: guard,
        }
    }

    /// Every span ended so far.
    fn spans(&self) -> Vec<SpanData> {
        self.provider.force_flush().expect("flush");
        self.exporter.get_finished_spans().expect("spans")
    }
}

fn attr(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.as_str().into_owned())
}

/// The one span named `name` for which `pick` holds; panics listing the spans otherwise.
fn one<'a>(spans: &'a [SpanData], name: &str, pick: impl Fn(&SpanData) -> bool) -> &'a SpanData {
    let found: Vec<&SpanData> = spans.iter().filter(|s| s.name == name && pick(s)).collect();
    assert_eq!(
        found.len(),
        1,
        "expected one span {name:?}; spans: {:#?}",
        spans
            .iter()
            .map(|s| (s.name.to_string(), s.attributes.clone()))
            .collect::<Vec<_>>()
    );
    found[0]
}

/// The W3C `traceparent` of a span as the propagator writes it.
fn traceparent(span: &SpanData) -> String {
    let c = &span.span_context;
    format!(
        "00-{}-{}-{:02x}",
        c.trace_id(),
        c.span_id(),
        c.trace_flags().to_u8()
    )
}

/// Whether `a` and `b` name the same span (a context read back from headers is remote,
/// the exported one is not).
fn same(a: &SpanContext, b: &SpanContext) -> bool {
    a.trace_id() == b.trace_id() && a.span_id() == b.span_id()
}

fn messaging(span: &SpanData, operation: &str, queue: Option<&str>) {
    assert_eq!(attr(span, "messaging.system").as_deref(), Some("outbox"));
    assert_eq!(
        attr(span, "messaging.operation.type").as_deref(),
        Some(operation)
    );
    assert_eq!(
        attr(span, "messaging.operation.name").as_deref(),
        Some(operation)
    );
    assert_eq!(attr(span, "messaging.destination.name").as_deref(), queue);
}

/// One publish, claim, run and ack through a started worker on Postgres: the span names,
/// kinds and attributes; `settle` a child of `process`; and the delivery linked to its
/// publish by the `traceparent` the publish wrote into the row.
#[tokio::test]
async fn one_message_gives_send_receive_process_settle() {
    let traces = Traces::install();
    let f = Fixture::new().await;
    let queue = "otel.tree";

    let request = tracing::info_span!("request");
    let published = async {
        let mut conn = f.pool.acquire().await.unwrap();
        f.outbox
            .publish(&mut conn, Message::new(queue, b"{}").timer_id("t-1"))
            .await
            .unwrap()
    }
    .instrument(request.clone())
    .await;
    drop(request);
    let id = published.id().expect("inserted");
    let row = f.only_row(queue).await;
    let headers = row
        .headers
        .clone()
        .expect("the publish wrote the trace context");

    let worker = Worker::builder(f.store.clone())
        .idle_poll(Duration::from_millis(50))
        .queue(queue, |_: Vec<u8>, _: Context| async {})
        .build()
        .unwrap()
        .start();
    eventually(20, "the message is acked", || async {
        f.rows(queue).await.is_empty()
    })
    .await;
    worker.shutdown().await;
    let spans = traces.spans();

    let request = one(&spans, "request", |_| true);
    let send = one(&spans, &format!("send {queue}"), |_| true);
    assert_eq!(send.span_kind, SpanKind::Producer);
    assert_eq!(
        send.parent_span_id,
        request.span_context.span_id(),
        "send is a child of the publishing request"
    );
    messaging(send, "send", Some(queue));
    assert_eq!(attr(send, "messaging.message.id"), Some(id.to_string()));
    assert_eq!(attr(send, "outbox.timer_id").as_deref(), Some("t-1"));
    assert_eq!(attr(send, "outbox.outcome").as_deref(), Some("inserted"));
    assert_eq!(attr(send, "error.type"), None);
    assert_eq!(
        headers.get(TRACEPARENT_HEADER),
        Some(&traceparent(send)),
        "the row carries the send span's context: {headers:?}"
    );
    assert!(
        !headers.contains_key(TRACESTATE_HEADER),
        "an empty trace state is not written: {headers:?}"
    );

    // The claim that took the row (idle claims before it returned nothing).
    let receive = one(&spans, &format!("receive {queue}"), |s| {
        attr(s, "messaging.batch.message_count").as_deref() == Some("1")
    });
    assert_eq!(receive.span_kind, SpanKind::Client);
    messaging(receive, "receive", Some(queue));
    assert_eq!(receive.parent_span_id, SpanId::INVALID, "a claim is a root");
    let creation = &send.span_context;
    let link = receive
        .links
        .links
        .iter()
        .find(|l| same(&l.span_context, creation))
        .expect("the receive span links to the message's creation context");
    assert!(
        link.attributes
            .iter()
            .any(|kv| kv.key.as_str() == "messaging.message.id"
                && kv.value.as_str() == id.to_string()),
        "{link:?}"
    );

    let process = one(&spans, &format!("process {queue}"), |_| true);
    assert_eq!(process.span_kind, SpanKind::Consumer);
    messaging(process, "process", Some(queue));
    assert_eq!(attr(process, "messaging.message.id"), Some(id.to_string()));
    assert_eq!(attr(process, "outbox.timer_id").as_deref(), Some("t-1"));
    assert_eq!(attr(process, "outbox.delivery").as_deref(), Some("1"));
    assert_eq!(attr(process, "outbox.attempt").as_deref(), Some("1"));
    assert_eq!(attr(process, "outbox.outcome").as_deref(), Some("ack"));
    assert_eq!(attr(process, "error.type"), None);
    assert_eq!(process.status, Status::Unset);
    assert_eq!(
        process.parent_span_id,
        SpanId::INVALID,
        "a run starts a trace of its own: the publish is a link, not its parent"
    );
    assert_ne!(
        process.span_context.trace_id(),
        send.span_context.trace_id()
    );
    let linked = &process.links.links;
    assert_eq!(linked.len(), 2, "{linked:?}");
    assert!(
        linked.iter().any(|l| same(&l.span_context, creation)),
        "process links to the publish through the traceparent header: {linked:?}"
    );
    assert!(
        linked
            .iter()
            .any(|l| same(&l.span_context, &receive.span_context)),
        "process follows from the claim that took its row: {linked:?}"
    );

    let settle = one(&spans, &format!("settle {queue}"), |_| true);
    assert_eq!(settle.span_kind, SpanKind::Client);
    messaging(settle, "settle", Some(queue));
    assert_eq!(
        settle.parent_span_id,
        process.span_context.span_id(),
        "settle is a child of process"
    );
    assert_eq!(
        settle.span_context.trace_id(),
        process.span_context.trace_id()
    );
    assert_eq!(attr(settle, "messaging.message.id"), Some(id.to_string()));
    assert_eq!(attr(settle, "outbox.outcome").as_deref(), Some("acked"));
    assert_eq!(attr(settle, "error.type"), None);
    assert!(settle.start_time >= process.start_time);
    f.cleanup().await;
}

/// Failures are errors on the span that failed: a handler error on `process` (its retry
/// written as asked, so `settle` is fine), a rejection ends in the dead-letter table with
/// its reason, and a lost lease is an error of `settle`. The second run of the retried
/// message counts its attempt.
#[tokio::test]
async fn outcomes_and_errors_are_recorded_on_the_spans() {
    let traces = Traces::install();
    let f = Fixture::new().await;
    let queue = "otel.outcomes";
    let runs = Arc::new(AtomicUsize::new(0));
    let worker = {
        let (runs, pool, table) = (runs.clone(), f.pool.clone(), f.outbox.table().to_owned());
        Worker::builder(f.store.clone())
            .idle_poll(Duration::from_millis(50))
            // One write per completion, so every settle is its own statement.
            .ack_batch_size(1)
            .queue_with(
                queue,
                move |payload: Vec<u8>, ctx: Context| {
                    let (runs, pool, table) = (runs.clone(), pool.clone(), table.clone());
                    async move {
                        runs.fetch_add(1, Ordering::SeqCst);
                        match (&payload[..], ctx.attempt()) {
                            (b"fail-once", 1) => Err("first run fails".to_owned()),
                            (b"reject", _) => Ok(Outcome::Reject("no".into())),
                            (b"steal", _) => {
                                // Another worker "reclaims" the row under our feet.
                                let sql = format!(
                                    "UPDATE {table} SET acquired_token = gen_random_uuid() WHERE id = $1"
                                );
                                sqlx::query(sqlx::AssertSqlSafe(sql))
                                    .bind(ctx.id())
                                    .execute(&pool)
                                    .await
                                    .map_err(|e| e.to_string())?;
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
    let mut ids = BTreeMap::new();
    let mut conn = f.pool.acquire().await.unwrap();
    for kind in ["fail-once", "reject", "steal"] {
        let published = f
            .outbox
            .publish(&mut conn, Message::new(queue, kind.as_bytes()))
            .await
            .unwrap();
        ids.insert(kind, published.id().unwrap().to_string());
    }
    // fail-once twice, reject once, steal once.
    eventually(20, "four runs", || async {
        runs.load(Ordering::SeqCst) >= 4
    })
    .await;
    eventually(20, "the settles are written", || async {
        traces
            .spans()
            .iter()
            .filter(|s| s.name == format!("settle {queue}"))
            .count()
            >= 4
    })
    .await;
    worker.shutdown().await;
    let spans = traces.spans();
    let by = |name: &str, kind: &str, attempt: Option<&str>| {
        one(&spans, &format!("{name} {queue}"), |s| {
            attr(s, "messaging.message.id").as_ref() == Some(&ids[kind])
                && (attempt.is_none() || attr(s, "outbox.attempt").as_deref() == attempt)
        })
        .clone()
    };
    let child = |process: &SpanData| {
        one(&spans, &format!("settle {queue}"), |s| {
            s.parent_span_id == process.span_context.span_id()
        })
        .clone()
    };

    let failed = by("process", "fail-once", Some("1"));
    assert_eq!(attr(&failed, "outbox.outcome").as_deref(), Some("retry"));
    assert_eq!(
        attr(&failed, "error.type").as_deref(),
        Some("handler_error")
    );
    assert!(matches!(failed.status, Status::Error { .. }), "{failed:?}");
    let retried = child(&failed);
    assert_eq!(attr(&retried, "outbox.outcome").as_deref(), Some("retried"));
    assert_eq!(attr(&retried, "error.type"), None);
    assert!(
        retried
            .events
            .events
            .iter()
            .any(|e| e.name.contains("retry scheduled")),
        "the retry event lands in settle: {:?}",
        retried.events
    );
    let second = by("process", "fail-once", Some("2"));
    assert_eq!(attr(&second, "outbox.delivery").as_deref(), Some("2"));
    assert_eq!(attr(&second, "outbox.outcome").as_deref(), Some("ack"));
    assert_eq!(
        attr(&child(&second), "outbox.outcome").as_deref(),
        Some("acked")
    );

    let rejected = by("process", "reject", None);
    assert_eq!(attr(&rejected, "outbox.outcome").as_deref(), Some("fail"));
    assert_eq!(
        attr(&rejected, "outbox.failure_reason").as_deref(),
        Some("rejected")
    );
    assert_eq!(attr(&rejected, "error.type").as_deref(), Some("rejected"));
    let dead = child(&rejected);
    assert_eq!(
        attr(&dead, "outbox.outcome").as_deref(),
        Some("dead_lettered")
    );
    assert_eq!(
        attr(&dead, "outbox.failure_reason").as_deref(),
        Some("rejected")
    );
    assert!(
        dead.events
            .events
            .iter()
            .any(|e| e.name.contains("dead letter written")),
        "{:?}",
        dead.events
    );

    let stolen = by("process", "steal", None);
    assert_eq!(attr(&stolen, "outbox.outcome").as_deref(), Some("ack"));
    let lost = child(&stolen);
    assert_eq!(attr(&lost, "outbox.outcome").as_deref(), Some("lease_lost"));
    assert_eq!(attr(&lost, "error.type").as_deref(), Some("lease_lost"));
    assert!(matches!(lost.status, Status::Error { .. }), "{lost:?}");
    let event = lost
        .events
        .events
        .iter()
        .find(|e| e.name.contains("lease lost"))
        .expect("the lease_lost event lands in settle");
    assert!(
        event
            .attributes
            .iter()
            .any(|kv| kv.key.as_str() == "phase" && kv.value.as_str() == "ack"),
        "{event:?}"
    );
    f.cleanup().await;
}

/// The trace context is added only when it fits: headers close to the limit publish
/// without it (and do not fail), a `traceparent` of the caller's is kept, other headers
/// are kept beside the added context, and a batch's items carry the batch's context.
#[tokio::test]
async fn trace_context_respects_the_header_limit_and_the_callers_headers() {
    let traces = Traces::install();
    let f = Fixture::new().await;
    let queue = "otel.headers";
    let mut conn = f.pool.acquire().await.unwrap();

    // 10 bytes below the limit: the 66 bytes of `traceparent` do not fit.
    let mut near = Headers::new();
    near.insert("k".into(), "v".repeat(MAX_HEADERS_BYTES - 1 - 10));
    let near_id = f
        .outbox
        .publish(&mut conn, Message::new(queue, b"near").headers(&near))
        .await
        .expect("a header near the limit still publishes")
        .id()
        .unwrap();

    let mut own = Headers::new();
    own.insert(
        TRACEPARENT_HEADER.into(),
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
    );
    let own_id = f
        .outbox
        .publish(&mut conn, Message::new(queue, b"own").headers(&own))
        .await
        .unwrap()
        .id()
        .unwrap();

    let mut small = Headers::new();
    small.insert("content-type".into(), "application/json".into());
    let small_id = f
        .outbox
        .publish(&mut conn, Message::new(queue, b"small").headers(&small))
        .await
        .unwrap()
        .id()
        .unwrap();

    let batch_ids = f
        .outbox
        .publish_batch(
            &mut conn,
            queue,
            &[
                BatchItem::new(b"b1"),
                BatchItem {
                    payload: b"b2",
                    headers: Some(&small),
                },
            ],
            Duration::from_secs(3600),
        )
        .await
        .unwrap();

    let rows: BTreeMap<i64, Option<Headers>> = f
        .rows(queue)
        .await
        .into_iter()
        .map(|r| (r.id, r.headers))
        .collect();
    let spans = traces.spans();
    let sends: Vec<&SpanData> = spans
        .iter()
        .filter(|s| s.name == format!("send {queue}"))
        .collect();
    let send_of = |id: i64| {
        *sends
            .iter()
            .find(|s| attr(s, "messaging.message.id") == Some(id.to_string()))
            .unwrap_or_else(|| panic!("no send span for {id}: {sends:#?}"))
    };

    assert_eq!(
        rows[&near_id].as_ref(),
        Some(&near),
        "headers near the limit are stored as given, without trace context"
    );
    assert_eq!(
        attr(send_of(near_id), "outbox.outcome").as_deref(),
        Some("inserted")
    );
    assert_eq!(
        rows[&own_id].as_ref(),
        Some(&own),
        "the caller's traceparent wins"
    );
    let mut want = small.clone();
    want.insert(TRACEPARENT_HEADER.into(), traceparent(send_of(small_id)));
    assert_eq!(rows[&small_id].as_ref(), Some(&want));

    let batch = one(&spans, &format!("send {queue}"), |s| {
        attr(s, "messaging.batch.message_count").as_deref() == Some("2")
    });
    assert_eq!(
        attr(batch, "outbox.outcome").as_deref(),
        Some("batch_inserted")
    );
    let context = traceparent(batch);
    assert_eq!(
        rows[&batch_ids[0]]
            .as_ref()
            .and_then(|h| h.get(TRACEPARENT_HEADER)),
        Some(&context)
    );
    let mut want = small.clone();
    want.insert(TRACEPARENT_HEADER.into(), context);
    assert_eq!(rows[&batch_ids[1]].as_ref(), Some(&want));
    f.cleanup().await;
}

/// A non-empty trace state travels in `tracestate` beside `traceparent`; a `tracestate` of
/// the caller's (without a `traceparent`) is kept, and the `traceparent` added.
#[tokio::test]
async fn a_trace_state_is_written_and_the_callers_is_kept() {
    let traces = Traces::install();
    let f = Fixture::new().await;
    let queue = "otel.state";
    // The request continues a remote trace whose state names a vendor (as an incoming
    // HTTP request with `tracestate` would); its spans inherit the state.
    let remote = SpanContext::new(
        TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap(),
        SpanId::from_hex("b7ad6b7169203331").unwrap(),
        TraceFlags::SAMPLED,
        true,
        TraceState::from_key_value([("vendor", "opaque")]).unwrap(),
    );
    let remote_trace = remote.trace_id();
    let request = tracing::info_span!("request");
    request
        .set_parent(opentelemetry::Context::new().with_remote_span_context(remote))
        .unwrap();
    let mut theirs = Headers::new();
    theirs.insert(TRACESTATE_HEADER.into(), "mine=1".into());
    let (plain, kept) = async {
        let mut conn = f.pool.acquire().await.unwrap();
        let plain = f
            .outbox
            .publish(&mut conn, Message::new(queue, b"a"))
            .await
            .unwrap();
        let kept = f
            .outbox
            .publish(&mut conn, Message::new(queue, b"b").headers(&theirs))
            .await
            .unwrap();
        (plain.id().unwrap(), kept.id().unwrap())
    }
    .instrument(request)
    .await;
    let rows: BTreeMap<i64, Headers> = f
        .rows(queue)
        .await
        .into_iter()
        .map(|r| (r.id, r.headers.unwrap_or_default()))
        .collect();
    let spans = traces.spans();
    let send = one(&spans, &format!("send {queue}"), |s| {
        attr(s, "messaging.message.id") == Some(plain.to_string())
    });
    assert_eq!(
        send.span_context.trace_id(),
        remote_trace,
        "the send span continues the request's trace"
    );
    assert_eq!(
        rows[&plain].get(TRACEPARENT_HEADER),
        Some(&traceparent(send))
    );
    assert_eq!(
        rows[&plain].get(TRACESTATE_HEADER).map(String::as_str),
        Some("vendor=opaque")
    );
    assert_eq!(
        rows[&kept].get(TRACESTATE_HEADER).map(String::as_str),
        Some("mine=1"),
        "the caller's tracestate stays"
    );
    assert!(
        rows[&kept].contains_key(TRACEPARENT_HEADER),
        "{:?}",
        rows[&kept]
    );
    f.cleanup().await;
}

/// Without an OpenTelemetry layer the feature writes nothing: a publish under a plain
/// `tracing` subscriber (or none) stores the headers it was given.
#[tokio::test]
async fn without_an_opentelemetry_layer_nothing_is_written() {
    let f = Fixture::new().await;
    let queue = "otel.none";
    let _guard = tracing::subscriber::set_default(tracing_subscriber::registry());
    let mut conn = f.pool.acquire().await.unwrap();
    let span = tracing::info_span!("request");
    f.outbox
        .publish(&mut conn, Message::new(queue, b"x"))
        .instrument(span)
        .await
        .unwrap();
    assert_eq!(f.only_row(queue).await.headers, None);
    f.cleanup().await;
}

/// The in-memory store publishes and delivers with the same spans and trace context, and
/// `run_due` puts its claim and runs under the caller's span.
#[tokio::test]
async fn the_memory_store_links_the_same_way() {
    let traces = Traces::install();
    let store = MemoryStore::new();
    let queue = "otel.memory";
    async {
        (&store)
            .publish_message(Message::new(queue, b"m"))
            .await
            .unwrap();
    }
    .instrument(tracing::info_span!("request"))
    .await;
    let worker = Worker::builder(store.clone())
        .queue(queue, |_: Vec<u8>, _: Context| async {})
        .build()
        .unwrap();
    let test = tracing::info_span!("test");
    let done = worker.run_due().instrument(test.clone()).await.unwrap();
    drop(test);
    assert_eq!(done.len(), 1);
    let spans = traces.spans();
    let send = one(&spans, &format!("send {queue}"), |_| true);
    assert_eq!(
        done[0]
            .delivery
            .headers
            .as_ref()
            .and_then(|h| h.get(TRACEPARENT_HEADER)),
        Some(&traceparent(send))
    );
    let test = one(&spans, "test", |_| true);
    let receive = one(&spans, &format!("receive {queue}"), |s| {
        attr(s, "messaging.batch.message_count").as_deref() == Some("1")
    });
    assert_eq!(receive.parent_span_id, test.span_context.span_id());
    let process = one(&spans, &format!("process {queue}"), |_| true);
    assert_eq!(
        process.parent_span_id,
        test.span_context.span_id(),
        "run_due's runs are children of the caller's span"
    );
    assert!(process
        .links
        .links
        .iter()
        .any(|l| same(&l.span_context, &send.span_context)));
    let settle = one(&spans, &format!("settle {queue}"), |_| true);
    assert_eq!(settle.parent_span_id, process.span_context.span_id());
    assert_eq!(attr(settle, "outbox.outcome").as_deref(), Some("acked"));
}
