//! One module per page; each reads with the library's API or `crate::sql` and renders with
//! `crate::layout`.

pub(crate) mod dead_letters;
pub(crate) mod queue;
pub(crate) mod queues;
pub(crate) mod row;
pub(crate) mod schedules;
pub(crate) mod schema;
