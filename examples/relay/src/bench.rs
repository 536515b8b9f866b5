//! `relay bench`: the relay's throughput into JetStream (or RabbitMQ, `--amqp`) from a
//! backlog, and the latency from a publish's commit to the broker at a steady rate.
//!
//! Throughput: `messages` rows are published first (in batches of 1 000, no relay
//! running), then one relay worker starts; the figure is rows over the time until the
//! stream holds them all. Latency: one autocommit publish per message at `rate` per second
//! for `seconds`; each message carries the local time taken just before its publish
//! (header `committed-us`; the publish's own statement and commit count in the latency),
//! and the latency is the stream's own timestamp of the stored message minus it (one
//! machine, one clock). RabbitMQ stamps no time on a message: there the latency is the
//! local time a consumer of the queue (auto-ack, on its own connection) receives the
//! message minus the same header, so the broker's delivery to the consumer is in it too.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt;
use outbox::message::{BatchItem, Headers};
use outbox::relay::{self, Relay, Subject};
use outbox::{Message, Outbox, PgStore, Worker};
use sqlx::postgres::PgPoolOptions;
use sqlx::AssertSqlSafe;

/// Any error of the demo or the bench, for its message.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn now_us() -> i64 {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

async fn stream_count(js: &jetstream::Context, name: &str) -> Result<u64, BoxError> {
    Ok(js.get_stream(name).await?.info().await?.state.messages)
}

pub(crate) async fn run(
    messages: usize,
    concurrency: usize,
    rate: u64,
    seconds: u64,
) -> Result<bool, BoxError> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".to_owned());
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..10];
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&url)
        .await?;
    let outbox = Outbox::builder()
        .table(format!("relay_bench_{suffix}"))
        .build()?;
    outbox.migrate(&pool).await?;
    let js = jetstream::new(async_nats::connect(&nats_url).await?);
    let name = format!("RELAY_BENCH_{}", suffix.to_uppercase());
    let subject = format!("relay_bench_{suffix}");
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![format!("{subject}.>")],
        ..Default::default()
    })
    .await?;
    let result = measure(
        &pool,
        &outbox,
        &js,
        &name,
        &subject,
        messages,
        concurrency,
        rate,
        seconds,
    )
    .await;
    let _ = js.delete_stream(&name).await;
    let drop = format!(
        "DROP TABLE IF EXISTS {}, {}, {}, {}",
        outbox.table(),
        outbox.dead_letter_table(),
        outbox.migrations_table(),
        outbox.paused_table()
    );
    let _ = sqlx::raw_sql(AssertSqlSafe(drop)).execute(&pool).await;
    result
}

/// The backlog into RabbitMQ: a fresh queue on the default exchange, the relay's routing
/// key its name, publisher confirms; timed until the queue holds every message.
pub(crate) async fn run_amqp(
    messages: usize,
    concurrency: usize,
    rate: u64,
    seconds: u64,
) -> Result<bool, BoxError> {
    use lapin::options::{
        BasicConsumeOptions, QueueDeclareOptions, QueueDeleteOptions, QueuePurgeOptions,
    };
    use lapin::types::FieldTable;
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let amqp_url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..10];
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&url)
        .await?;
    let outbox = Outbox::builder()
        .table(format!("relay_bench_{suffix}"))
        .build()?;
    outbox.migrate(&pool).await?;
    let conn =
        lapin::Connection::connect(&amqp_url, lapin::ConnectionProperties::default()).await?;
    let channel = conn.create_channel().await?;
    let queue = format!("relay_bench_{suffix}");
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let count = || async {
        let q = channel
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        Ok::<u32, BoxError>(q.message_count())
    };
    backlog(&pool, &outbox, messages).await?;
    let worker = Worker::builder(PgStore::new(pool.clone(), outbox.clone()))
        .concurrency(concurrency)
        .fetch_batch_size(concurrency.min(1000))
        .relay(
            ["bench"],
            relay::amqp(amqp_url.clone(), "").routing_key(relay::RoutingKey::Fixed(queue.clone())),
        )
        .build()?
        .start();
    let started = Instant::now();
    let mut done = true;
    while (count().await? as usize) < messages {
        if started.elapsed() > Duration::from_secs(600) {
            done = false;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let took = started.elapsed();
    println!(
        "backlog: {messages} rows relayed into RabbitMQ (persistent, mandatory, confirms) in {:.2} s: {:.0} msg/s (concurrency {concurrency})",
        took.as_secs_f64(),
        messages as f64 / took.as_secs_f64()
    );
    if done && seconds > 0 {
        // The steady rate, read back by a consumer of the queue, emptied first.
        channel
            .queue_purge(queue.as_str().into(), QueuePurgeOptions::default())
            .await?;
        let consumer_conn =
            lapin::Connection::connect(&amqp_url, lapin::ConnectionProperties::default()).await?;
        let consumer_channel = consumer_conn.create_channel().await?;
        let mut incoming = consumer_channel
            .basic_consume(
                queue.as_str().into(),
                "bench".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        let total = usize::try_from(rate * seconds)?;
        let reader = tokio::spawn(async move {
            let mut latencies_us: Vec<i64> = Vec::with_capacity(total);
            let end = tokio::time::Instant::now() + Duration::from_secs(seconds + 30);
            while latencies_us.len() < total {
                let Ok(Some(Ok(d))) = tokio::time::timeout_at(end, incoming.next()).await else {
                    break;
                };
                let received = now_us();
                let sent = d
                    .properties
                    .headers()
                    .as_ref()
                    .and_then(|h| h.inner().get("committed-us").cloned())
                    .and_then(|v| match v {
                        lapin::types::AMQPValue::LongString(s) => {
                            std::str::from_utf8(s.as_bytes()).ok()?.parse::<i64>().ok()
                        }
                        _ => None,
                    });
                if let Some(sent) = sent {
                    latencies_us.push(received - sent);
                }
            }
            latencies_us
        });
        steady(&pool, &outbox, rate, total).await?;
        let latencies = reader.await?;
        done = report("commit → consumer", rate, seconds, total, latencies);
        drop(consumer_conn);
    }
    worker.shutdown().await;
    let _ = channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await;
    let drop = format!(
        "DROP TABLE IF EXISTS {}, {}, {}, {}",
        outbox.table(),
        outbox.dead_letter_table(),
        outbox.migrations_table(),
        outbox.paused_table()
    );
    let _ = sqlx::raw_sql(AssertSqlSafe(drop)).execute(&pool).await;
    Ok(done)
}

/// `messages` rows of 100 bytes in queue `bench`, 1 000 a statement.
async fn backlog(pool: &sqlx::PgPool, outbox: &Outbox, messages: usize) -> Result<(), BoxError> {
    let payload = vec![b'x'; 100];
    let items: Vec<BatchItem<'_>> = (0..1000).map(|_| BatchItem::new(&payload)).collect();
    let mut conn = pool.acquire().await?;
    let mut left = messages;
    while left > 0 {
        let n = left.min(items.len());
        outbox
            .publish_batch(&mut conn, "bench", &items[..n], Duration::ZERO)
            .await?;
        left -= n;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn measure(
    pool: &sqlx::PgPool,
    outbox: &Outbox,
    js: &jetstream::Context,
    name: &str,
    subject: &str,
    messages: usize,
    concurrency: usize,
    rate: u64,
    seconds: u64,
) -> Result<bool, BoxError> {
    backlog(pool, outbox, messages).await?;
    let worker = Worker::builder(PgStore::new(pool.clone(), outbox.clone()))
        .concurrency(concurrency)
        .fetch_batch_size(concurrency.min(1000))
        .relay(
            ["bench"],
            Relay::new(relay::nats(
                js.clone(),
                Subject::from_queue(format!("{subject}.")),
            )),
        )
        .build()?
        .start();
    let started = Instant::now();
    while stream_count(js, name).await? < messages as u64 {
        if started.elapsed() > Duration::from_secs(600) {
            return Err("the backlog was not relayed within 10 minutes".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let backlog = started.elapsed();
    println!(
        "backlog: {messages} rows relayed into JetStream in {:.2} s: {:.0} msg/s (concurrency {concurrency})",
        backlog.as_secs_f64(),
        messages as f64 / backlog.as_secs_f64()
    );

    // The steady rate, read back from the stream with the stream's timestamps.
    let stream = js.get_stream(name).await?;
    let consumer = stream
        .create_consumer(consumer::pull::Config {
            ack_policy: consumer::AckPolicy::None,
            deliver_policy: consumer::DeliverPolicy::New,
            ..Default::default()
        })
        .await?;
    let mut incoming = consumer.messages().await?;
    let total = usize::try_from(rate * seconds)?;
    let reader = tokio::spawn(async move {
        let mut latencies_us: Vec<i64> = Vec::with_capacity(total);
        let end = tokio::time::Instant::now() + Duration::from_secs(seconds + 30);
        while latencies_us.len() < total {
            let Ok(Some(Ok(m))) = tokio::time::timeout_at(end, incoming.next()).await else {
                break;
            };
            let sent = m
                .headers
                .as_ref()
                .and_then(|h| h.get("committed-us"))
                .and_then(|v| v.as_str().parse::<i64>().ok());
            let (Some(sent), Ok(info)) = (sent, m.info()) else {
                continue;
            };
            let stored = i64::try_from(info.published.unix_timestamp_nanos() / 1000).unwrap_or(0);
            latencies_us.push(stored - sent);
        }
        latencies_us
    });
    steady(pool, outbox, rate, total).await?;
    let latencies = reader.await?;
    worker.shutdown().await;
    Ok(report("commit → stream", rate, seconds, total, latencies))
}

/// Publishes `total` messages of 100 bytes to `bench` at `rate` per second, one autocommit
/// statement each, each with the local time just before its publish in `committed-us`.
async fn steady(
    pool: &sqlx::PgPool,
    outbox: &Outbox,
    rate: u64,
    total: usize,
) -> Result<(), BoxError> {
    let payload = vec![b'x'; 100];
    let period = Duration::from_micros(1_000_000 / rate.max(1));
    let mut tick = tokio::time::interval(period);
    let mut conn = pool.acquire().await?;
    for _ in 0..total {
        tick.tick().await;
        // The time just before the publish (an autocommit statement): its statement and
        // commit count in the latency.
        let headers: Headers = [("committed-us".to_owned(), now_us().to_string())]
            .into_iter()
            .collect();
        outbox
            .publish(&mut conn, Message::new("bench", &payload).headers(&headers))
            .await?;
    }
    Ok(())
}

/// Prints the latency percentiles of the steady phase; whether every message came back.
fn report(what: &str, rate: u64, seconds: u64, total: usize, mut latencies: Vec<i64>) -> bool {
    latencies.sort_unstable();
    let pct = |p: f64| -> f64 {
        if latencies.is_empty() {
            return f64::NAN;
        }
        let i = ((latencies.len() as f64 - 1.0) * p).round() as usize;
        latencies[i] as f64 / 1000.0
    };
    println!(
        "steady: {rate} msg/s for {seconds} s (one autocommit publish each): {} of {total} read back; {what} p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        latencies.len(),
        pct(0.5),
        pct(0.99),
        pct(1.0)
    );
    latencies.len() == total
}
