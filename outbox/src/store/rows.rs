//! Decoding claimed rows (the columns of `sql::claim::DELIVERY_COLUMNS`, in order).

use sqlx::postgres::PgRow;
use sqlx::Row;

use super::{Delivery, Lease};
use crate::error::Result;
use crate::read::headers_from;

pub(crate) fn delivery_from_row(row: &PgRow) -> Result<Delivery> {
    Ok(Delivery {
        lease: Lease {
            id: row.try_get(0)?,
            token: row.try_get(1)?,
        },
        queue: row.try_get(2)?,
        payload: row.try_get(3)?,
        headers: headers_from(row, 4)?,
        timer_id: row.try_get(5)?,
        attempts_count: row.try_get(6)?,
        deliveries_count: row.try_get(7)?,
        created_at: row.try_get(8)?,
        deadline: row.try_get(9)?,
        first_attempt_at: row.try_get(10)?,
        claimed_at: row.try_get(11)?,
    })
}
