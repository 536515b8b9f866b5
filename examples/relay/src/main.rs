//! The relay example: `relay demo --messages N` publishes N messages in domain
//! transactions (each one inserts an order row and publishes its event in the same
//! transaction), relays them to NATS JetStream with `outbox::relay::nats` while a consumer
//! reads the stream, and checks that every message arrived exactly once (one stream message
//! per row, by `Nats-Msg-Id` and by content) and, per key, in the order it was committed.
//! It prints a summary and exits non-zero when a check fails.
//!
//! Postgres from `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`), NATS
//! from `NATS_URL` (default `127.0.0.1:4222`, JetStream enabled). The demo makes its own
//! tables and stream (unique names) and removes them at the end.

use std::collections::{BTreeMap, HashSet};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, stream};
use clap::{Parser, Subcommand};
use futures::StreamExt;
use outbox::message::Headers;
use outbox::relay::{self, Relay, Subject};
use outbox::{Message, Outbox, PgStore, Worker};
use sqlx::postgres::PgPoolOptions;
use sqlx::AssertSqlSafe;

#[derive(Parser)]
#[command(about = "The outbox relay example")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Publish messages in domain transactions, relay them to JetStream, check them there.
    Demo {
        /// How many messages.
        #[arg(long, default_value_t = 1000)]
        messages: usize,
        /// How many keys (each message has one, in the header `key`; order is checked per key).
        #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
        keys: u64,
        /// The relay's publishes in flight (the worker's concurrency); the relay is ordered by
        /// the header `key`, so each key has one message in flight at a time.
        #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
        concurrency: u64,
        /// Give up when the stream does not hold every message after this many seconds.
        #[arg(long, default_value_t = 120)]
        timeout_secs: u64,
        /// Publish every message first, then start the relay: measures how fast a backlog
        /// drains (the relay's own speed) rather than how fast the publisher goes.
        #[arg(long)]
        backlog: bool,
    },
    /// Measure: relay throughput into JetStream from a backlog, then the latency from
    /// commit to the stream at a steady publishing rate.
    Bench {
        /// Rows in the backlog.
        #[arg(long, default_value_t = 100_000)]
        messages: usize,
        /// The relay's publishes in flight.
        #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
        concurrency: u64,
        /// Messages per second in the latency phase (one transaction each).
        #[arg(long, default_value_t = 1000)]
        rate: u64,
        /// Seconds of the latency phase.
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        /// Measure into RabbitMQ (`AMQP_URL`, default
        /// `amqp://guest:guest@127.0.0.1:5672/%2f`) instead, with publisher confirms; the
        /// latency phase reads the queue with a consumer (commit → consumer).
        #[arg(long)]
        amqp: bool,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            // lapin logs a returned message whole, payload included, at WARN.
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,lapin::returned_messages=error".into()),
        )
        // Colours only for a terminal: a redirected log stays plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    let done = match Cli::parse().command {
        Command::Demo {
            messages,
            keys,
            concurrency,
            timeout_secs,
            backlog,
        } => {
            let shape = Shape {
                messages,
                keys: usize::try_from(keys).unwrap_or(usize::MAX),
                concurrency: usize::try_from(concurrency).unwrap_or(usize::MAX),
                timeout: Duration::from_secs(timeout_secs),
                backlog,
            };
            demo(shape).await
        }
        Command::Bench {
            messages,
            concurrency,
            rate,
            seconds,
            amqp: false,
        } => {
            bench::run(
                messages,
                usize::try_from(concurrency).unwrap_or(usize::MAX),
                rate,
                seconds,
            )
            .await
        }
        Command::Bench {
            messages,
            concurrency,
            rate,
            seconds,
            amqp: true,
        } => {
            let concurrency = usize::try_from(concurrency).unwrap_or(usize::MAX);
            bench::run_amqp(messages, concurrency, rate, seconds).await
        }
    };
    match done {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("relay: {e}");
            ExitCode::from(2)
        }
    }
}

mod bench;

use bench::BoxError;

/// What the consumer saw: per row id the number of copies, per key the sequence numbers in
/// stream order.
#[derive(Default)]
struct Seen {
    copies: BTreeMap<String, usize>,
    per_key: BTreeMap<String, Vec<u64>>,
    total: usize,
}

/// What the demo publishes and how it relays.
#[derive(Clone, Copy)]
struct Shape {
    messages: usize,
    keys: usize,
    concurrency: usize,
    timeout: Duration,
    /// Publish everything before the relay starts.
    backlog: bool,
}

async fn demo(shape: Shape) -> Result<bool, BoxError> {
    let url = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".to_owned());
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..10];
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&url)
        .await
        .map_err(|e| format!("cannot connect to {url}: {e}"))?;
    let outbox = Outbox::builder()
        .table(format!("relay_demo_{suffix}"))
        .dead_letter(true)
        .build()?;
    outbox.migrate(&pool).await?;
    // The index the relay guide recommends for a relay ordered by a header: it serves the
    // claim's look for an earlier row of each key and for the rows of a key's run.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE INDEX ON {} (queue, (headers ->> 'key'), id) WHERE headers ? 'key'",
        outbox.table()
    )))
    .execute(&pool)
    .await?;
    let orders = format!("relay_demo_orders_{suffix}");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {orders} (id bigserial PRIMARY KEY, key text NOT NULL, seq bigint NOT NULL)"
    )))
    .execute(&pool)
    .await?;

    let nats = async_nats::connect(&nats_url)
        .await
        .map_err(|e| format!("cannot connect to NATS at {nats_url}: {e}"))?;
    let js = jetstream::new(nats);
    let stream_name = format!("RELAY_DEMO_{}", suffix.to_uppercase());
    let subject = format!("relay_demo_{suffix}");
    let stream = js
        .create_stream(stream::Config {
            name: stream_name.clone(),
            subjects: vec![format!("{subject}.>")],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        })
        .await?;

    let result = run(&pool, &outbox, &orders, &js, &stream, &subject, shape).await;

    let _ = js.delete_stream(&stream_name).await;
    let drop = format!(
        "DROP TABLE IF EXISTS {orders}, {}, {}, {}, {}",
        outbox.table(),
        outbox.dead_letter_table(),
        outbox.migrations_table(),
        outbox.paused_table()
    );
    let _ = sqlx::raw_sql(AssertSqlSafe(drop)).execute(&pool).await;
    result
}

async fn run(
    pool: &sqlx::PgPool,
    outbox: &Outbox,
    orders: &str,
    js: &jetstream::Context,
    stream: &stream::Stream,
    subject: &str,
    shape: Shape,
) -> Result<bool, BoxError> {
    let Shape {
        messages,
        keys,
        concurrency,
        timeout,
        backlog,
    } = shape;
    // The consumer reads the stream from its start while the relay fills it.
    let consumer = stream
        .create_consumer(consumer::pull::Config {
            ack_policy: consumer::AckPolicy::None,
            deliver_policy: consumer::DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut incoming = consumer.messages().await?;
    let reader = tokio::spawn(async move {
        let mut seen = Seen::default();
        let end = tokio::time::Instant::now() + timeout;
        while seen.total < messages {
            let next = tokio::time::timeout_at(end, incoming.next()).await;
            let Ok(Some(Ok(m))) = next else { break };
            seen.total += 1;
            let headers = m.headers.clone().unwrap_or_default();
            let id = headers
                .get("Nats-Msg-Id")
                .map(|v| v.as_str().to_owned())
                .unwrap_or_default();
            *seen.copies.entry(id).or_default() += 1;
            let key = headers
                .get("key")
                .map(|v| v.as_str().to_owned())
                .unwrap_or_default();
            let seq = headers
                .get("seq")
                .and_then(|v| v.as_str().parse::<u64>().ok())
                .unwrap_or(u64::MAX);
            seen.per_key.entry(key).or_default().push(seq);
        }
        seen
    });

    let store = PgStore::new(pool.clone(), outbox.clone());
    let relay = Worker::builder(store)
        .concurrency(concurrency.max(1))
        .fetch_batch_size(100)
        .relay(
            ["orders.created"],
            Relay::new(relay::nats(
                js.clone(),
                Subject::from_queue(format!("{subject}.")),
            ))
            .ordered_by_header("key"),
        )
        .build()?;
    let (mut unstarted, mut worker) = if backlog {
        (Some(relay), None)
    } else {
        (None, Some(relay.start()))
    };

    // The domain transactions: an order row and its event, committed together. Per key the
    // sequence numbers follow commit order (one publisher, one transaction after another).
    let started = Instant::now();
    let mut next_seq = vec![0u64; keys];
    for i in 0..messages {
        let k = i % keys;
        let seq = next_seq[k];
        next_seq[k] += 1;
        let key = format!("k{k}");
        let mut tx = pool.begin().await?;
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {orders} (key, seq) VALUES ($1, $2)"
        )))
        .bind(&key)
        .bind(i64::try_from(seq)?)
        .execute(&mut *tx)
        .await?;
        let payload = serde_json::to_vec(&serde_json::json!({ "key": key, "seq": seq }))?;
        let headers: Headers = [("key".to_owned(), key), ("seq".to_owned(), seq.to_string())]
            .into_iter()
            .collect();
        outbox
            .publish(
                &mut tx,
                Message::new("orders.created", &payload).headers(&headers),
            )
            .await?;
        tx.commit().await?;
    }
    let published = started.elapsed();
    let relay_started = Instant::now();
    if let Some(relay) = unstarted.take() {
        worker = Some(relay.start());
    }

    let seen = reader.await?;
    let relayed = started.elapsed();
    let drained = relay_started.elapsed();
    if let Some(worker) = worker {
        worker.shutdown().await;
    }
    let mut conn = pool.acquire().await?;
    let left = outbox.pending(&mut conn, "orders.created", 10).await?.len();
    let dead = outbox
        .dead_letters(&mut conn, &outbox::dlq::DeadLetterFilter::new(), None, 10)
        .await?
        .len();
    let info = js
        .get_stream(&stream.cached_info().config.name)
        .await?
        .info()
        .await?
        .state
        .messages;

    let duplicates = seen.copies.values().filter(|&&n| n > 1).count();
    let distinct: HashSet<(&String, u64)> = seen
        .per_key
        .iter()
        .flat_map(|(k, seqs)| seqs.iter().map(move |s| (k, *s)))
        .collect();
    let out_of_order: usize = seen
        .per_key
        .values()
        .map(|seqs| seqs.windows(2).filter(|w| w[1] <= w[0]).count())
        .sum();
    let exactly_once = seen.total == messages
        && seen.copies.len() == messages
        && duplicates == 0
        && distinct.len() == messages
        && info == messages as u64;
    let ok = exactly_once && out_of_order == 0 && left == 0 && dead == 0;
    let keys_word = if keys == 1 { "key" } else { "keys" };
    println!("relay demo: {messages} messages, {keys} {keys_word}, concurrency {concurrency}");
    println!(
        "  published in domain transactions: {:.2} s ({:.0} msg/s)",
        published.as_secs_f64(),
        messages as f64 / published.as_secs_f64()
    );
    if backlog {
        println!(
            "  the backlog relayed and consumed in: {:.2} s ({:.0} msg/s)",
            drained.as_secs_f64(),
            messages as f64 / drained.as_secs_f64()
        );
    } else {
        println!(
            "  all consumed from JetStream after: {:.2} s ({:.0} msg/s end to end)",
            relayed.as_secs_f64(),
            messages as f64 / relayed.as_secs_f64()
        );
    }
    println!(
        "  in the stream: {info}; consumed: {}; distinct message ids: {}; duplicates: {duplicates}",
        seen.total,
        seen.copies.len()
    );
    println!(
        "  out of order within a key: {out_of_order}; rows left: {left}; dead letters: {dead}"
    );
    println!(
        "  {}",
        if ok {
            "OK: every message exactly once, in commit order per key"
        } else {
            "FAILED"
        }
    );
    Ok(ok)
}
