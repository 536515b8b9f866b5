//! `sql/cancel.rs`: cancelling a keyed timer.

use super::state::{clear_rearm, State};
use crate::cancel::Cancelled;
use crate::error::Result;
use crate::message::{validate_queue, validate_timer_id};

impl State {
    /// `cancel.rs`: lock, then delete a pending row, or mark a running row cancelled
    /// (dropping its rearm).
    pub(super) fn cancel(&mut self, queue: &str, timer_id: &str) -> Result<Cancelled> {
        validate_queue(queue)?;
        validate_timer_id(timer_id)?;
        let Some(id) = self.timer_row(queue, timer_id) else {
            return Ok(Cancelled::NotFound);
        };
        let Some(row) = self.rows.get_mut(&id) else {
            return Ok(Cancelled::NotFound);
        };
        if row.acquired_token.is_none() {
            self.rows.remove(&id);
            return Ok(Cancelled::Deleted { id });
        }
        let had_rearm = row.rearm_at.is_some();
        clear_rearm(row);
        row.cancelled_at = Some(row.cancelled_at.unwrap_or(self.now));
        Ok(if had_rearm {
            Cancelled::RearmDropped { id }
        } else {
            Cancelled::Running { id }
        })
    }
}
