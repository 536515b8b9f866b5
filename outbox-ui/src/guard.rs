//! The dashboard's guards: the CSRF token and `Origin` check of every action, the security
//! headers of every response, and the basic-auth layer of `outbox ui`.

use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;
use base64::Engine as _;

/// Why an action was refused before it ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    ReadOnly,
    Token,
    Origin,
}

impl Refused {
    pub(crate) fn text(self) -> &'static str {
        match self {
            Refused::ReadOnly => "this dashboard is read-only: actions are turned off",
            Refused::Token => {
                "the form's CSRF token is missing or stale: reload the page and try again"
            }
            Refused::Origin => "the request comes from another site (its Origin or Referer names another host than this dashboard)",
        }
    }
}

/// Checks an action: not read-only, the token equals `expected` (in constant time), and the
/// `Origin` header (or, without one, the `Referer`) names the `Host` the request was sent to.
pub(crate) fn check(
    read_only: bool,
    headers: &HeaderMap,
    token: &str,
    expected: &str,
) -> Result<(), Refused> {
    if read_only {
        return Err(Refused::ReadOnly);
    }
    if !same_origin(headers) {
        return Err(Refused::Origin);
    }
    if !constant_time_eq(token.as_bytes(), expected.as_bytes()) {
        return Err(Refused::Token);
    }
    Ok(())
}

/// True when the `Origin` (or `Referer`) header, if any, has the request's `Host` as its
/// authority. Browsers send `Origin` with every cross-origin `POST`; a request without both
/// (a script, `curl`) is judged by its token alone. `Origin: null` (a sandboxed or
/// privacy-redirected page) is refused.
fn same_origin(headers: &HeaderMap) -> bool {
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    let source = headers
        .get(header::ORIGIN)
        .or_else(|| headers.get(header::REFERER));
    let Some(source) = source else {
        return true;
    };
    let (Some(host), Ok(source)) = (host, source.to_str()) else {
        return false;
    };
    let authority = source
        .strip_prefix("http://")
        .or_else(|| source.strip_prefix("https://"))
        .map(|rest| rest.split('/').next().unwrap_or(""));
    authority.is_some_and(|a| a.eq_ignore_ascii_case(host))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Refuses (400) a request whose query or form body does not decode to UTF-8 text, or
/// decodes to text with a NUL: axum's `Query` and `Form` decode lossily, so
/// `?name=%F0%28%8C%28` paused a queue named `\u{fffd}(\u{fffd}(` (a fresh-user trial); no
/// name, key or field the dashboard takes may hold NUL (the library's rule for names).
pub(crate) async fn text_only(request: Request, next: Next) -> Response {
    const FORM_LIMIT: usize = 2 * 1024 * 1024; // axum's default body limit
    if let Some(why) = request.uri().query().and_then(not_text) {
        return (
            StatusCode::BAD_REQUEST,
            format!("the address's query {why}"),
        )
            .into_response();
    }
    let form = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|c| c.to_str().ok())
        .is_some_and(|c| c.starts_with("application/x-www-form-urlencoded"));
    if !form {
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    let bytes = match axum::body::to_bytes(body, FORM_LIMIT).await {
        Ok(b) => b,
        Err(_) => {
            return (StatusCode::PAYLOAD_TOO_LARGE, "the form is too large").into_response();
        }
    };
    let why = match std::str::from_utf8(&bytes) {
        Err(_) => Some("is not UTF-8"),
        Ok(text) => not_text(text),
    };
    if let Some(why) = why {
        return (StatusCode::BAD_REQUEST, format!("the form {why}")).into_response();
    }
    next.run(Request::from_parts(parts, axum::body::Body::from(bytes)))
        .await
}

/// Why `s` (`application/x-www-form-urlencoded`: `+` a space, `%XX` a byte) is not text,
/// if it is not: a value or name that decodes to bytes that are not UTF-8, or to NUL.
fn not_text(s: &str) -> Option<&'static str> {
    for part in s.split(['&', '=']) {
        let decoded = percent_encoding::percent_decode_str(part).collect::<Vec<u8>>();
        match std::str::from_utf8(&decoded) {
            Err(_) => return Some("holds a value that is not UTF-8"),
            Ok(text) if text.contains('\0') => return Some("holds a NUL character"),
            Ok(_) => {}
        }
    }
    None
}

/// Headers on every response: a content security policy that allows only the dashboard's
/// own script and style, no framing, no sniffing, no referrer to other sites, no caching.
pub(crate) async fn headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

/// `router` behind HTTP basic authentication: a request without the `Authorization:
/// Basic` header of `user` and `password` is answered `401 Unauthorized` (with a
/// `WWW-Authenticate` challenge, so a browser asks). The comparison takes the same time
/// wherever the credentials differ. Basic auth sends the password with every request:
/// serve it over TLS (a reverse proxy) anywhere but on the loopback interface.
pub fn basic_auth(router: Router, user: &str, password: &str) -> Router {
    let expected = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    security_headers(router.layer(axum::middleware::from_fn(
        move |request: Request, next: Next| {
            let expected = expected.clone();
            async move {
                let given = request
                    .headers()
                    .get(header::AUTHORIZATION)
                    .map(HeaderValue::as_bytes)
                    .unwrap_or_default();
                if basic_credentials(given)
                    .is_some_and(|c| constant_time_eq(c, expected.as_bytes()))
                {
                    next.run(request).await
                } else {
                    (
                        StatusCode::UNAUTHORIZED,
                        [(
                            header::WWW_AUTHENTICATE,
                            "Basic realm=\"outbox\", charset=\"UTF-8\"",
                        )],
                        "authentication required\n",
                    )
                        .into_response()
                }
            }
        },
    )))
}

/// `router` with the dashboard's security headers on every response, including those of
/// layers outside the dashboard's own router (a `401` of [`basic_auth`], a refusal of the
/// application's): content security policy, no framing, `nosniff`, `no-store`.
pub fn security_headers(router: Router) -> Router {
    router.layer(axum::middleware::from_fn(headers))
}

/// The credentials of an `Authorization: Basic <credentials>` header: the scheme is
/// matched without regard to case (RFC 7235, 2.1), spaces around the credentials ignored.
fn basic_credentials(header: &[u8]) -> Option<&[u8]> {
    let space = header.iter().position(|&b| b == b' ')?;
    let (scheme, rest) = header.split_at(space);
    if !scheme.eq_ignore_ascii_case(b"basic") {
        return None;
    }
    Some(rest.trim_ascii())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(header::HeaderName, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn the_basic_scheme_is_case_insensitive() {
        assert_eq!(basic_credentials(b"Basic b3Bz"), Some(&b"b3Bz"[..]));
        assert_eq!(basic_credentials(b"basic b3Bz"), Some(&b"b3Bz"[..]));
        assert_eq!(basic_credentials(b"BASIC   b3Bz "), Some(&b"b3Bz"[..]));
        assert_eq!(basic_credentials(b"Bearer b3Bz"), None);
        assert_eq!(basic_credentials(b"Basicb3Bz"), None);
    }

    #[test]
    fn an_action_needs_the_token_and_the_same_origin() {
        let host = (header::HOST, "127.0.0.1:8080");
        let ok = headers(&[host.clone(), (header::ORIGIN, "http://127.0.0.1:8080")]);
        assert_eq!(check(false, &ok, "t0k", "t0k"), Ok(()));
        assert_eq!(check(true, &ok, "t0k", "t0k"), Err(Refused::ReadOnly));
        assert_eq!(check(false, &ok, "t0x", "t0k"), Err(Refused::Token));
        assert_eq!(check(false, &ok, "", "t0k"), Err(Refused::Token));
        let evil = headers(&[host.clone(), (header::ORIGIN, "http://evil.example")]);
        assert_eq!(check(false, &evil, "t0k", "t0k"), Err(Refused::Origin));
        let null = headers(&[host.clone(), (header::ORIGIN, "null")]);
        assert_eq!(check(false, &null, "t0k", "t0k"), Err(Refused::Origin));
        let prefix = headers(&[host.clone(), (header::ORIGIN, "http://127.0.0.1:80800")]);
        assert_eq!(check(false, &prefix, "t0k", "t0k"), Err(Refused::Origin));
        let referer = headers(&[
            host.clone(),
            (header::REFERER, "https://127.0.0.1:8080/outbox/"),
        ]);
        assert_eq!(check(false, &referer, "t0k", "t0k"), Ok(()));
        let none = headers(&[host]);
        assert_eq!(check(false, &none, "t0k", "t0k"), Ok(()));
    }
}
