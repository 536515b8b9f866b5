//! What the expansion needs, after parsing and validation: no tokens to re-check, no
//! `Option`s to unwrap.

use proc_macro2::Span;
use syn::{Ident, Path, Visibility};

/// A timer to expand: a non-generic struct with a validated queue and delivery limit.
pub(crate) struct Model {
    /// The payload type, as written.
    pub(crate) ident: Ident,
    /// The type's visibility, given to the generated functions too.
    pub(crate) vis: Visibility,
    /// `QUEUE`, checked.
    pub(crate) queue: String,
    /// `MAX_DELIVERIES`, checked.
    pub(crate) max_deliveries: u32,
    /// The runtime crate's path: `::outbox` unless `crate = "..."` says otherwise.
    pub(crate) krate: Path,
    /// The schedule declared with `every` or `cron`, checked; `None` without one.
    pub(crate) schedule: Option<Declared>,
}

/// A checked schedule declared on the type.
/// `span` is the `every` or `cron` string: where an unmet bound of the generated code (a
/// payload without `Default`) is reported.
pub(crate) enum Declared {
    /// `every = "..."`: the text as written (the runtime parses it again).
    Every { text: String, span: Span },
    /// `cron = "..."`, in zone `tz` (`"UTC"` when `tz` is not given).
    Cron {
        expr: String,
        tz: String,
        span: Span,
    },
}
