//! Timers written the way users write them, compiled under the strictest lints a user
//! might turn on. That this library builds cleanly (with `cargo clippy -- -D warnings` and
//! `RUSTDOCFLAGS=-Dwarnings cargo doc`) is itself the test that `#[timer]`'s expansion:
//! - passes `missing_docs` (every generated function is documented) and clippy's
//!   pedantic lints (`missing_errors_doc`, `doc_markdown`, …);
//! - passes `unused_qualifications` with the runtime's names imported;
//! - does not pick up a shadowed `Result`, `Option`, `Into`, `Sized`, `str` or `u32`, nor a
//!   payload type named `P`;
//! - works for named, tuple and unit structs with `pub`, `pub(crate)` and private
//!   visibility, two or more timers in one module, a timer in a nested module used from
//!   another module, and `crate = "..."` through a re-export.
//!
//! The tests in `tests/` use these types: `expand.rs` (consts, signatures), `postgres.rs`
//! (round trips on a real database) and `ui.rs` (trybuild compile-fail cases).
#![deny(
    missing_docs,
    unused,
    unused_qualifications,
    rust_2018_idioms,
    unreachable_pub
)]
#![deny(clippy::all, clippy::pedantic)]

// Imported so that an unnecessarily qualified path in generated code would trip
// `unused_qualifications`.
#[allow(unused_imports)]
use outbox::{message::Schedule, Cancelled, Error, Published, Publisher, Timer};
use serde::{Deserialize, Serialize};

/// A user's presence expiry: a named-field, `pub` timer (the SPEC's motivating example).
#[outbox::timer(queue = "presence.expiry", max_deliveries = 5)]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PresenceExpiry {
    /// The user whose presence expires.
    pub user_id: i64,
}

/// A second timer in the same module: a unit struct, `pub(crate)`.
#[outbox::timer(queue = "maintenance:tick_1", max_deliveries = 1)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Tick;

/// A third one: a tuple struct, private, with the largest `max_deliveries` and a `u32`
/// suffix.
#[outbox::timer(queue = "orders.reminder-2", max_deliveries = 4_294_967_295u32)]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Reminder(i64, String);

/// The derive written above the attribute works too, and serde attributes apply as usual.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[outbox::timer(queue = "billing.retry", max_deliveries = 10)]
#[serde(rename_all = "camelCase")]
pub struct BillingRetry {
    /// The invoice to charge again.
    pub invoice_id: i64,
}

/// `(QUEUE, MAX_DELIVERIES)` of the crate-private timers, for the tests.
#[must_use]
pub fn private_timer_consts() -> [(&'static str, u32); 2] {
    [
        (<Tick as Timer>::QUEUE, <Tick as Timer>::MAX_DELIVERIES),
        (Reminder::QUEUE, Reminder::MAX_DELIVERIES),
    ]
}

/// Publishes the private timers through their generated functions (which are private and
/// `pub(crate)` too), so the tests can exercise them. `conn` is used twice, so it must be a
/// shared reference such as `&pool` or `&store`.
///
/// # Errors
/// What the generated functions return.
pub async fn publish_private_timers<P: Publisher + Copy>(
    conn: P,
    timer_id: &str,
) -> Result<[Published; 2], Error> {
    let tick = publish_tick(conn, timer_id, &Tick, Schedule::now()).await?;
    let reminder = extend_reminder(
        conn,
        timer_id,
        &Reminder(7, "seven".to_owned()),
        std::time::Duration::from_hours(1),
    )
    .await?;
    Ok([tick, reminder])
}

/// Cancels what [`publish_private_timers`] published.
///
/// # Errors
/// What the generated functions return.
pub async fn cancel_private_timers<P: Publisher + Copy>(
    conn: P,
    timer_id: &str,
) -> Result<[Cancelled; 2], Error> {
    Ok([
        cancel_tick(conn, timer_id).await?,
        cancel_reminder(conn, timer_id).await?,
    ])
}

/// Timers inside nested modules.
pub mod nested {
    /// One level deeper.
    pub mod deeper {
        // As at the crate root: would trip `unused_qualifications` on a needless path.
        #[allow(unused_imports)]
        use outbox::{message::Schedule, Cancelled, Error, Published, Publisher, Timer};
        use serde::{Deserialize, Serialize};

        /// An operator's answer time-out: declared here, used from [`crate::caller`].
        #[outbox::timer(queue = "operator.timeout", max_deliveries = 3)]
        #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
        pub struct OperatorTimeout {
            /// The waiting conversation.
            pub conversation: String,
            /// How many reminders were sent so far.
            pub reminders: u32,
        }
    }
}

/// Uses the nested module's timer from elsewhere, through its generated functions.
pub mod caller {
    use std::time::Duration;

    use crate::nested::deeper::{
        cancel_operator_timeout, extend_operator_timeout, OperatorTimeout,
    };

    /// Starts or pushes back a conversation's operator time-out by 30 s.
    ///
    /// # Errors
    /// What the generated function returns.
    pub async fn touch(
        conn: impl outbox::Publisher,
        conversation: &str,
        reminders: u32,
    ) -> Result<outbox::Published, outbox::Error> {
        let payload = OperatorTimeout {
            conversation: conversation.to_owned(),
            reminders,
        };
        extend_operator_timeout(conn, conversation, &payload, Duration::from_secs(30)).await
    }

    /// Schedules a conversation's operator time-out unless one is live, naming the
    /// generated function by its full path.
    ///
    /// # Errors
    /// What the generated function returns.
    pub async fn start(
        conn: impl outbox::Publisher,
        conversation: &str,
    ) -> Result<outbox::Published, outbox::Error> {
        let payload = OperatorTimeout {
            conversation: conversation.to_owned(),
            reminders: 0,
        };
        crate::nested::deeper::publish_operator_timeout(
            conn,
            conversation,
            &payload,
            Duration::from_secs(30),
        )
        .await
    }

    /// Stops a conversation's operator time-out.
    ///
    /// # Errors
    /// What the generated function returns.
    pub async fn stop(
        conn: impl outbox::Publisher,
        conversation: &str,
    ) -> Result<outbox::Cancelled, outbox::Error> {
        cancel_operator_timeout(conn, conversation).await
    }
}

/// A module that shadows every prelude name the expansion could lean on.
#[allow(non_camel_case_types, dead_code)]
pub mod shadowed {

    type Result<T> = core::result::Result<T, ()>;
    enum Option {}
    trait Into {}
    trait Sized {}
    trait Send {}
    trait Sync {}
    struct str;
    struct u32;
    struct Error;
    struct Publisher;
    struct Schedule;
    struct Published;
    struct Cancelled;
    struct Timer;
    mod outbox {}

    /// A payload named like the generated functions' generic parameter would be, were it
    /// not `__P`.
    ///
    /// Its serde impls are hand-written outside this module: serde's derive itself does
    /// not survive a shadowed `str`.
    #[::outbox::timer(queue = "shadowed.p", max_deliveries = 2)]
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct P {
        /// A field.
        pub n: i64,
    }
}

mod shadowed_serde {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::shadowed::P;

    impl Serialize for P {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            serializer.serialize_i64(self.n)
        }
    }

    impl<'de> Deserialize<'de> for P {
        fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
            i64::deserialize(deserializer).map(|n| P { n })
        }
    }
}

/// `crate = "..."`: a crate that re-exports `outbox` and lets its users name the runtime
/// only through the re-export.
pub mod reexport {
    /// The re-export the attribute is redirected to.
    pub use ::outbox as runtime;
    // As at the crate root: would trip `unused_qualifications` on a needless path.
    #[allow(unused_imports)]
    use {
        runtime::message::Schedule, runtime::Cancelled, runtime::Error, runtime::Published,
        runtime::Publisher, runtime::Timer,
    };

    use serde::{Deserialize, Serialize};

    /// A timer whose expansion names `crate::reexport::runtime::…`, not `::outbox::…`.
    #[runtime::timer(
        queue = "reexported",
        max_deliveries = 9,
        crate = "crate::reexport::runtime"
    )]
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct Reexported;
}
