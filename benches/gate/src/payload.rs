//! The benchmark's message type: the reference's body, a 256-byte string stored as JSON.
// The macro generates `cancel_body` too; the benchmark has no use for it.
#![allow(dead_code)]

use serde::{Deserialize, Serialize};

/// A newtype over the body string, so the stored JSON is the string itself (as the
/// reference stores it) and handlers decode it through the typed path.
#[outbox::timer(queue = "bench", max_deliveries = 5)]
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Body(pub String);
