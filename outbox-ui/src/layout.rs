//! The page shell (navigation, notices, the embedded style and script), the request's
//! mount point, and the pieces every page uses: forms with the CSRF token, error pages.

use axum::extract::{FromRequestParts, OriginalUri};
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use maud::{html, Markup, DOCTYPE};

use crate::state::Inner;

const CSS: &str = include_str!("../assets/app.css");
const JS: &str = include_str!("../assets/app.js");

pub(crate) async fn css() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=3600"),
        ],
        CSS,
    )
        .into_response()
}

pub(crate) async fn js() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=3600"),
        ],
        JS,
    )
        .into_response()
}

/// Where the router is mounted (`/outbox`, or empty at the root), from the request's
/// original path and the path the router saw.
#[derive(Debug, Clone)]
pub(crate) struct Base(pub String);

impl<S: Send + Sync> FromRequestParts<S> for Base {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let inner = parts.uri.path().to_owned();
        let original = parts
            .extensions
            .get::<OriginalUri>()
            .map_or_else(|| inner.clone(), |o| o.path().to_owned());
        let base = match original.strip_suffix(inner.as_str()) {
            Some(b) => b.to_owned(),
            None => original.trim_end_matches('/').to_owned(),
        };
        Ok(Base(base.trim_end_matches('/').to_owned()))
    }
}

impl Base {
    /// `path` (starting with `/`) under the mount point. The root under a mount is the
    /// mount itself (`/outbox`): a router nested by axum answers there, not at `/outbox/`.
    pub(crate) fn to(&self, path: &str) -> String {
        match (self.0.is_empty(), path) {
            (false, "/") => self.0.clone(),
            _ => format!("{}{path}", self.0),
        }
    }
}

pub(crate) use crate::notice::{Kind, Notice};

/// The page of `queue` (`what` None) or one of its actions (`pause`, `resume`, `cancel`),
/// relative to the mount: the name travels in the query (`/queue?name=…`), never in the
/// path, so every name the library accepts works, `.` and `..` (which browsers resolve
/// away in a path, even percent-encoded) and names with `/`, `?`, `#` or `%` included.
pub(crate) fn queue_path(queue: &str, what: Option<&str>) -> String {
    match what {
        None => format!("/queue?name={}", encode(queue)),
        Some(w) => format!("/queue/{w}?name={}", encode(queue)),
    }
}

/// The query of a queue's page or action: its name.
#[derive(Debug, Default, serde::Deserialize)]
pub(crate) struct Named {
    pub name: Option<String>,
}

/// Percent-encodes `s` for a query value or a path segment.
pub(crate) fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The page around `body`: the navigation (the current section marked), the notices, the
/// style and the script. `refresh` asks the script to reload `main` every 5 s.
pub(crate) fn page(
    base: &Base,
    inner: &Inner,
    title: &str,
    section: &str,
    notice: &Notice,
    refresh: bool,
    body: Markup,
) -> Markup {
    let nav = [
        ("queues", "/", "Queues"),
        (
            "dead-letters",
            "/dead-letters",
            if inner.outbox.dead_letter_enabled() {
                "Dead letters"
            } else {
                "Dead letters (off)"
            },
        ),
        ("schedules", "/schedules", "Schedules"),
        ("schema", "/schema", "Schema"),
    ];
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · outbox" }
                link rel="stylesheet" href=(base.to("/assets/app.css"));
                script src=(base.to("/assets/app.js")) defer {}
            }
            body {
                a.skip href="#main" { "Skip to content" }
                header {
                    nav aria-label="Sections" {
                        span.brand { "outbox" }
                        ul {
                            @for (id, path, label) in nav {
                                li {
                                    @if id == section {
                                        a href=(base.to(path)) aria-current="page" { (label) }
                                    } @else {
                                        a href=(base.to(path)) { (label) }
                                    }
                                }
                            }
                        }
                        @if inner.read_only {
                            span.badge title="Actions are turned off" { "read-only" }
                        }
                    }
                }
                main id="main" tabindex="-1" data-refresh=[refresh.then_some("5000")] {
                    h1 { (title) }
                    div role="status" aria-live="polite" {
                        @match notice.shown(&inner.notice_key, chrono::Utc::now().timestamp()) {
                            Some((Kind::Ok, text)) => p.notice.ok { (text) },
                            Some((Kind::Error, text)) => p.notice.error { (text) },
                            None => {}
                        }
                    }
                    (body)
                }
            }
        }
    }
}

/// A `POST` form to `action` with the CSRF token, `fields` as hidden inputs and one
/// button; nothing in read-only mode. `confirm` adds the `data-confirm` text the script
/// asks about (without script the action runs as a plain form).
pub(crate) fn button(
    inner: &Inner,
    action: &str,
    fields: &[(&str, &str)],
    label: &str,
    class: &str,
) -> Markup {
    if inner.read_only {
        return html! {};
    }
    html! {
        form.inline method="post" action=(action) {
            input type="hidden" name="csrf" value=(inner.csrf);
            @for (name, value) in fields {
                input type="hidden" name=(name) value=(value);
            }
            button type="submit" class=(class) { (label) }
        }
    }
}

/// An error page: `status`, a title and the reason, escaped.
pub(crate) fn error(
    base: &Base,
    inner: &Inner,
    status: StatusCode,
    title: &str,
    reason: &str,
) -> Response {
    let body = html! {
        p.notice.error { (reason) }
        p { a href=(base.to("/")) { "Back to the queues" } }
    };
    (
        status,
        page(base, inner, title, "", &Notice::default(), false, body),
    )
        .into_response()
}

/// The error page of a request the dashboard refuses (400), saying why.
pub(crate) fn bad_request(base: &Base, inner: &Inner, reason: &str) -> Response {
    error(base, inner, StatusCode::BAD_REQUEST, "Bad request", reason)
}

/// The error page of something that is not there (404), saying what.
pub(crate) fn not_found(base: &Base, inner: &Inner, reason: &str) -> Response {
    error(base, inner, StatusCode::NOT_FOUND, "Not found", reason)
}

/// The page for a failed database read or library call.
pub(crate) fn failed(base: &Base, inner: &Inner, e: &dyn std::fmt::Display) -> Response {
    error(
        base,
        inner,
        StatusCode::INTERNAL_SERVER_ERROR,
        "Error",
        &e.to_string(),
    )
}

/// Replaces the plain-text bodies of axum's own refusals (a path or query that does not
/// parse, a form that is not a form, no such route, a wrong method) with the dashboard's
/// error page, saying what was wrong. Responses the dashboard rendered itself (HTML) and
/// downloads pass unchanged.
pub(crate) async fn plain_errors(
    axum::extract::State(s): axum::extract::State<crate::state::State>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let (mut parts, body) = request.into_parts();
    let Ok(base) = Base::from_request_parts(&mut parts, &()).await;
    let response = next
        .run(axum::extract::Request::from_parts(parts, body))
        .await;
    let status = response.status();
    let html = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|c| c.to_str().ok())
        .is_some_and(|c| c.starts_with("text/html"));
    if !status.is_client_error() || html {
        return response;
    }
    let text = axum::body::to_bytes(response.into_body(), 16 * 1024)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_owned())
        .unwrap_or_default();
    let (title, reason) = match status {
        StatusCode::NOT_FOUND => (
            "Not found",
            "the dashboard has no page at this address".to_owned(),
        ),
        StatusCode::METHOD_NOT_ALLOWED => (
            "Method not allowed",
            "this address does not take that method (an action is a POST of its page's form)"
                .to_owned(),
        ),
        StatusCode::UNSUPPORTED_MEDIA_TYPE => (
            "Bad request",
            format!("the action was not sent as a form ({text})"),
        ),
        _ => (
            "Bad request",
            if text.is_empty() {
                "the request could not be read".to_owned()
            } else {
                format!("the address or form could not be read: {text}")
            },
        ),
    };
    error(&base, &s, status, title, &reason)
}
