//! A worker's behaviour: how a run ends, wake-ups without polling, reliability when rows,
//! handlers or the database misbehave, a handler's own transaction, fairness across queues,
//! periodic timers, `run_due` in virtual time, what it logs, and one path for a claimed row
//! whether a worker was started or `run_due` runs it.

mod fairness;
mod one_path;
mod periodic;
mod reliability;
mod runs;
mod transaction;
mod virtual_time;
pub(crate) mod wakeups;
mod warnings;
