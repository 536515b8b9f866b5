//! What `#[timer]` expands to, without a database: the `Timer` consts, the JSON encoding,
//! the generated functions' signatures, and what they hand to the `Publisher` (through a
//! recording fake).
#![deny(unused_qualifications)]

use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use outbox::{message::Schedule, Cancelled, Message, Published, Publisher, Timer};
use outbox_macro_tests::nested::deeper::{
    cancel_operator_timeout, extend_operator_timeout, publish_operator_timeout, OperatorTimeout,
};
use outbox_macro_tests::reexport::{
    cancel_reexported, extend_reexported, publish_reexported, Reexported,
};
use outbox_macro_tests::shadowed::{cancel_p, extend_p, publish_p, P};
use outbox_macro_tests::{
    cancel_presence_expiry, extend_presence_expiry, private_timer_consts, publish_presence_expiry,
    PresenceExpiry,
};

#[test]
fn consts_come_from_the_attribute() {
    assert_eq!(<PresenceExpiry as Timer>::QUEUE, "presence.expiry");
    assert_eq!(<PresenceExpiry as Timer>::MAX_DELIVERIES, 5);
    assert_eq!(OperatorTimeout::QUEUE, "operator.timeout");
    assert_eq!(OperatorTimeout::MAX_DELIVERIES, 3);
    assert_eq!(P::QUEUE, "shadowed.p");
    assert_eq!(P::MAX_DELIVERIES, 2);
    assert_eq!(Reexported::QUEUE, "reexported");
    assert_eq!(Reexported::MAX_DELIVERIES, 9);
    assert_eq!(
        private_timer_consts(),
        [("maintenance:tick_1", 1), ("orders.reminder-2", u32::MAX)]
    );
}

/// Usable in const contexts, as associated consts should be.
const _: () = assert!(PresenceExpiry::MAX_DELIVERIES == 5);

#[test]
fn payloads_are_json() {
    let payload = PresenceExpiry { user_id: 42 };
    let bytes = payload.encode().unwrap();
    assert_eq!(bytes, br#"{"user_id":42}"#);
    assert_eq!(PresenceExpiry::decode(&bytes).unwrap(), payload);
    assert!(PresenceExpiry::decode(b"{}").is_err());

    // serde's attributes shape the stored JSON.
    let retry = outbox_macro_tests::BillingRetry { invoice_id: 3 };
    assert_eq!(retry.encode().unwrap(), br#"{"invoiceId":3}"#);
    assert_eq!(outbox_macro_tests::BillingRetry::QUEUE, "billing.retry");
    let _ = |pool: &sqlx::PgPool| {
        drop(outbox_macro_tests::cancel_billing_retry(pool, "1"));
    };
}

/// A `Publisher` that records what it is asked to do.
#[derive(Default)]
struct Recorder {
    calls: Mutex<Vec<String>>,
}

impl Publisher for &Recorder {
    fn publish_message<'m>(
        self,
        message: Message<'m>,
    ) -> impl Future<Output = outbox::Result<Published>> + Send {
        self.calls.lock().unwrap().push(format!("{message:?}"));
        async { Ok(Published::Inserted { id: 1 }) }
    }

    fn cancel_timer(
        self,
        queue: &str,
        timer_id: &str,
    ) -> impl Future<Output = outbox::Result<Cancelled>> + Send {
        self.calls
            .lock()
            .unwrap()
            .push(format!("cancel {queue} {timer_id}"));
        async { Ok(Cancelled::NotFound) }
    }
}

fn assert_send<T: Send>(value: T) -> T {
    value
}

#[tokio::test]
async fn functions_pass_queue_key_payload_and_conflict_mode() {
    let rec = Recorder::default();
    let payload = PresenceExpiry { user_id: 7 };

    // Each generated future is `Send`, so it can be awaited inside a spawned task.
    let published = assert_send(publish_presence_expiry(
        &rec,
        "7",
        &payload,
        Duration::from_secs(60),
    ))
    .await
    .unwrap();
    assert_eq!(published, Published::Inserted { id: 1 });
    assert_send(extend_presence_expiry(&rec, "7", &payload, Schedule::now()))
        .await
        .unwrap();
    let cancelled = assert_send(cancel_presence_expiry(&rec, "7"))
        .await
        .unwrap();
    assert_eq!(cancelled, Cancelled::NotFound);

    let calls = rec.calls.into_inner().unwrap();
    assert_eq!(calls.len(), 3, "{calls:?}");
    for call in &calls[..2] {
        assert!(call.contains(r#"queue: "presence.expiry""#), "{call}");
        assert!(call.contains(r#"timer_id: Some("7")"#), "{call}");
        // The payload is the struct's JSON.
        let json: Vec<String> = br#"{"user_id":7}"#.iter().map(u8::to_string).collect();
        assert!(
            call.contains(&format!("payload: [{}]", json.join(", "))),
            "{call}"
        );
    }
    assert!(calls[0].contains("on_conflict: Ignore"), "{}", calls[0]);
    assert!(calls[1].contains("on_conflict: Extend"), "{}", calls[1]);
    assert_eq!(calls[2], "cancel presence.expiry 7");
}

#[tokio::test]
async fn every_timer_gets_its_own_functions() {
    let rec = Recorder::default();
    let timeout = OperatorTimeout {
        conversation: "c1".into(),
        reminders: 0,
    };
    publish_operator_timeout(&rec, "c1", &timeout, SystemTime::now())
        .await
        .unwrap();
    extend_operator_timeout(&rec, "c1", &timeout, Duration::ZERO)
        .await
        .unwrap();
    cancel_operator_timeout(&rec, "c1").await.unwrap();
    outbox_macro_tests::caller::touch(&rec, "c2", 1)
        .await
        .unwrap();
    outbox_macro_tests::caller::start(&rec, "c3").await.unwrap();
    outbox_macro_tests::caller::stop(&rec, "c2").await.unwrap();

    publish_p(&rec, "p", &P { n: 3 }, Duration::ZERO)
        .await
        .unwrap();
    extend_p(&rec, "p", &P { n: 4 }, Duration::ZERO)
        .await
        .unwrap();
    cancel_p(&rec, "p").await.unwrap();

    publish_reexported(&rec, "r", &Reexported, Duration::ZERO)
        .await
        .unwrap();
    extend_reexported(&rec, "r", &Reexported, Duration::ZERO)
        .await
        .unwrap();
    cancel_reexported(&rec, "r").await.unwrap();

    outbox_macro_tests::publish_private_timers(&rec, "x")
        .await
        .unwrap();
    outbox_macro_tests::cancel_private_timers(&rec, "x")
        .await
        .unwrap();

    let calls = rec.calls.into_inner().unwrap();
    let queues: Vec<&str> = calls
        .iter()
        .map(|c| {
            c.strip_prefix("cancel ")
                .map(|rest| rest.split(' ').next().unwrap())
                .unwrap_or_else(|| c.split('"').nth(1).unwrap())
        })
        .collect();
    assert_eq!(
        queues,
        [
            "operator.timeout",
            "operator.timeout",
            "operator.timeout",
            "operator.timeout",
            "operator.timeout",
            "operator.timeout",
            "shadowed.p",
            "shadowed.p",
            "shadowed.p",
            "reexported",
            "reexported",
            "reexported",
            "maintenance:tick_1",
            "orders.reminder-2",
            "maintenance:tick_1",
            "orders.reminder-2",
        ]
    );
    // `P`'s hand-written serde impl writes the bare number.
    let p: Vec<String> = b"3".iter().map(u8::to_string).collect();
    assert!(
        calls[6].contains(&format!("payload: [{}]", p.join(", "))),
        "{}",
        calls[6]
    );
}

/// Compile-only: the generated functions accept every `Publisher` the runtime offers and
/// every schedule type, and return the runtime's outcome types.
#[allow(dead_code)]
async fn accepts_every_connection_kind(
    conn: &mut sqlx::PgConnection,
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    pooled: &mut sqlx::pool::PoolConnection<sqlx::Postgres>,
    pool: &sqlx::PgPool,
    outbox: &outbox::Outbox,
    store: &outbox::PgStore,
    memory: &outbox::testing::MemoryStore,
) -> Result<(), outbox::Error> {
    let payload = PresenceExpiry { user_id: 1 };
    let _: Published =
        publish_presence_expiry(&mut *conn, "1", &payload, Duration::from_secs(1)).await?;
    let _: Published = publish_presence_expiry(&mut **tx, "1", &payload, Schedule::now()).await?;
    let _: Published = extend_presence_expiry(&mut *tx, "1", &payload, SystemTime::now()).await?;
    let _: Published =
        extend_presence_expiry(&mut *pooled, "1", &payload, Schedule::after(Duration::ZERO))
            .await?;
    let _: Published = extend_presence_expiry(&mut **pooled, "1", &payload, Duration::ZERO).await?;
    let _: Published = publish_presence_expiry(pool, "1", &payload, Duration::ZERO).await?;
    let _: Published = publish_presence_expiry(store, "1", &payload, Duration::ZERO).await?;
    let _: Published = publish_presence_expiry(memory, "1", &payload, Duration::ZERO).await?;
    let _: Cancelled = cancel_presence_expiry(outbox.on(&mut *conn), "1").await?;
    let _: Cancelled = cancel_presence_expiry(&mut outbox.on(tx), "1").await?;
    let _: Cancelled = cancel_presence_expiry(pool, "1").await?;
    let _: Cancelled = cancel_presence_expiry(store, "1").await?;
    // Through a generic function, as user code generic over `Publisher` does.
    async fn generic<C: Publisher>(c: C) -> outbox::Result<Cancelled> {
        cancel_presence_expiry(c, "1").await
    }
    let _ = generic(conn).await?;
    Ok(())
}
