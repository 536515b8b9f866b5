//! Downloads of what a page shows only in part: a row's payload and headers (and its queued
//! rearm's), a dead letter's payload and headers, the stored bytes whole, as
//! `application/octet-stream` attachments (a browser saves them, never renders them).

use axum::extract::{Path, State};
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use outbox::dlq::DeadLetterFilter;

use crate::layout::{self, Base};
use crate::sql;
use crate::state::State as Shared;

/// What a row's download is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    Payload,
    Headers,
    RearmPayload,
    RearmHeaders,
}

impl Part {
    const EVERY: [Part; 4] = [
        Part::Payload,
        Part::Headers,
        Part::RearmPayload,
        Part::RearmHeaders,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Part::Payload => "payload",
            Part::Headers => "headers",
            Part::RearmPayload => "rearm-payload",
            Part::RearmHeaders => "rearm-headers",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Self::EVERY.into_iter().find(|p| p.as_str() == s)
    }
}

fn attachment(name: &str, body: Vec<u8>) -> Response {
    let disposition = HeaderValue::from_str(&format!("attachment; filename=\"{name}\""))
        .unwrap_or_else(|_| HeaderValue::from_static("attachment"));
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            ),
            (header::CONTENT_DISPOSITION, disposition),
        ],
        body,
    )
        .into_response()
}

fn json_bytes(v: Option<&serde_json::Value>) -> Vec<u8> {
    v.and_then(|v| serde_json::to_vec_pretty(v).ok())
        .unwrap_or_else(|| b"null".to_vec())
}

/// `/rows/{id}/download/{payload|headers|rearm-payload|rearm-headers}`.
pub(crate) async fn row(
    State(s): State<Shared>,
    base: Base,
    Path((id, what)): Path<(String, String)>,
) -> Response {
    let bad = |reason: String| layout::bad_request(&base, &s, &reason);
    let Some(id) = id.parse::<i64>().ok().filter(|id| *id > 0) else {
        return bad(format!("bad row id {id:?}: row ids are positive integers"));
    };
    let Some(part) = Part::parse(&what) else {
        return bad(format!(
            "unknown download {what:?}: use payload, headers, rearm-payload or rearm-headers"
        ));
    };
    let row = match s.pool.acquire().await {
        Ok(mut conn) => sql::row(&s.sql, &s.outbox, &mut conn, id).await,
        Err(e) => Err(e),
    };
    let r = match row {
        Ok(Some(r)) => r,
        Ok(None) => return layout::not_found(&base, &s, &format!("no live row has id {id}")),
        Err(e) => return layout::failed(&base, &s, &e),
    };
    let name = format!("row-{id}-{}.bin", part.as_str());
    match part {
        Part::Payload => attachment(&name, r.payload),
        Part::Headers => attachment(&name, json_bytes(r.headers.as_ref())),
        Part::RearmPayload => match r.rearm_payload {
            Some(p) => attachment(&name, p),
            None => layout::not_found(
                &base,
                &s,
                &format!("row {id} has no queued rearm with a payload of its own"),
            ),
        },
        Part::RearmHeaders => attachment(&name, json_bytes(r.rearm_headers.as_ref())),
    }
}

/// `/dead-letters/{id}/download/{payload|headers}`.
pub(crate) async fn dead_letter(
    State(s): State<Shared>,
    base: Base,
    Path((id, what)): Path<(String, String)>,
) -> Response {
    let bad = |reason: String| layout::bad_request(&base, &s, &reason);
    let Some(id) = id.parse::<i64>().ok().filter(|id| *id > 0) else {
        return bad(format!(
            "bad dead-letter id {id:?}: dead-letter ids are positive integers"
        ));
    };
    let part = match Part::parse(&what) {
        Some(p @ (Part::Payload | Part::Headers)) => p,
        _ => return bad(format!("unknown download {what:?}: use payload or headers")),
    };
    let read = async {
        let mut conn = s.pool.acquire().await?;
        let filter = DeadLetterFilter::new().include_redriven(true);
        let found = s
            .outbox
            .dead_letters(&mut conn, &filter, Some(id - 1), 1)
            .await?;
        Ok::<_, outbox::Error>(found.into_iter().find(|d| d.id == id))
    };
    let d = match read.await {
        Ok(Some(d)) => d,
        Ok(None) => return layout::not_found(&base, &s, &format!("no dead letter has id {id}")),
        Err(e) => return layout::failed(&base, &s, &e),
    };
    let name = format!("dead-letter-{id}-{}.bin", part.as_str());
    match part {
        Part::Headers => match (&d.raw_headers, &d.headers) {
            (Some(raw), _) => attachment(&name, raw.clone().into_bytes()),
            (None, h) => attachment(
                &name,
                json_bytes(h.as_ref().map(|h| serde_json::json!(h)).as_ref()),
            ),
        },
        _ => attachment(&name, d.payload),
    }
}
