//! The NATS JetStream sink (feature `relay-nats`, on async-nats): each message is published
//! with `Nats-Msg-Id` and awaited until the stream's publish ack.

use std::error::Error as _;

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::ErrorCode;
use async_nats::HeaderMap;
use futures::future::BoxFuture;

use super::{BrokerMessage, Sink, SinkError};

/// Where a message goes: a fixed subject, or one made of the queue name (and a header).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subject {
    kind: SubjectKind,
    /// A header whose value is appended as a last token.
    header: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum SubjectKind {
    Fixed(String),
    FromQueue(String),
}

impl Subject {
    /// Every message to `subject` (for example `orders.created`).
    pub fn fixed(subject: impl Into<String>) -> Self {
        Subject {
            kind: SubjectKind::Fixed(subject.into()),
            header: None,
        }
    }

    /// `prefix` followed by the queue name: `Subject::from_queue("outbox.")` sends the
    /// queue `orders` to `outbox.orders`. The prefix is empty or ends in `.` (`"outbox"`
    /// would make `outboxorders`), and the queue names must be valid subject tokens
    /// (dot-separated, no whitespace, `*` or `>`), checked when the relay is registered.
    pub fn from_queue(prefix: impl Into<String>) -> Self {
        Subject {
            kind: SubjectKind::FromQueue(prefix.into()),
            header: None,
        }
    }

    /// Appends `.` and the value of the message header `name` as the subject's last token
    /// (`outbox.orders.eu` for `tenant: eu`), so consumers can filter by it. A message
    /// without the header, or whose value is not one subject token, is rejected (and so
    /// retried, then dead-lettered with the reason). The name must not be empty (checked when
    /// the relay is registered).
    pub fn with_header(mut self, name: impl Into<String>) -> Self {
        self.header = Some(name.into());
        self
    }

    fn base(&self, queue: &str) -> String {
        match &self.kind {
            SubjectKind::Fixed(s) => s.clone(),
            SubjectKind::FromQueue(prefix) => format!("{prefix}{queue}"),
        }
    }

    /// The rules of a subject that hold whatever the queue: see [`Sink::check`].
    fn check(&self) -> Result<(), String> {
        match &self.kind {
            SubjectKind::Fixed(s) => check_subject(s)?,
            SubjectKind::FromQueue(prefix) if prefix.is_empty() => {}
            SubjectKind::FromQueue(prefix) => match prefix.strip_suffix('.') {
                Some(tokens) => check_subject(tokens)
                    .map_err(|e| format!("`Subject::from_queue` prefix `{prefix}`: {e}"))?,
                None => {
                    return Err(format!(
                        "`Subject::from_queue` prefix `{prefix}` must end in `.` (or be empty): the queue name is a token of its own"
                    ))
                }
            },
        }
        if let Some(name) = &self.header {
            if name.is_empty() || name.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(format!(
                    "`Subject::with_header` needs a header name without whitespace, got `{name}`"
                ));
            }
        }
        Ok(())
    }

    fn render(&self, message: &BrokerMessage) -> Result<String, String> {
        let mut subject = self.base(&message.queue);
        if let Some(name) = &self.header {
            let value = message.headers.get(name).ok_or_else(|| {
                format!("the subject needs the header `{name}`, which the message does not have")
            })?;
            check_token(value).map_err(|e| format!("header `{name}`: {e}"))?;
            subject.push('.');
            subject.push_str(value);
        }
        Ok(subject)
    }
}

/// A subject token: non-empty, no whitespace, `.`, `*` or `>`.
fn check_token(token: &str) -> Result<(), String> {
    if token.is_empty() {
        return Err("an empty subject token".to_owned());
    }
    if token
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '.' | '*' | '>'))
    {
        return Err(format!(
            "`{token}` is not a subject token (no whitespace, `.`, `*` or `>`)"
        ));
    }
    Ok(())
}

fn check_subject(subject: &str) -> Result<(), String> {
    subject
        .split('.')
        .try_for_each(check_token)
        .map_err(|e| format!("subject `{subject}`: {e}"))
}

/// The JetStream sink: built by [`nats`], configured with [`NatsSink::expected_stream`].
#[derive(Debug, Clone)]
pub struct NatsSink {
    jetstream: async_nats::jetstream::Context,
    subject: Subject,
    expected_stream: Option<String>,
}

/// A relay to NATS JetStream over `jetstream` (an [`async_nats::jetstream::Context`] over
/// the connection you configured: servers, credentials, TLS, reconnect delays), publishing
/// to `subject`. The subject must belong to a stream: a publish that finds none is the
/// broker being unavailable (the relay pauses, nothing is dead-lettered).
///
/// Each message carries the row's headers and `Nats-Msg-Id` = the row's message id, so the
/// stream drops a redelivery within its duplicate window (its `duplicate_window`; set it
/// longer than the worker's `lease_ttl`). Publishes pipeline up to the context's
/// `max_ack_inflight` (async-nats' default 5 000) and wait for the ack up to the context's
/// own publish-ack timeout and the relay's
/// [`publish_timeout`](super::Relay::publish_timeout), whichever ends first.
///
/// What counts as the message's fault ([`SinkError::Rejected`]): a message larger than
/// the server's `max_payload`, one the stream refuses for its size (`max_msg_size`), a
/// failed expectation on the last message, a header name NATS cannot carry, a header value
/// with a line break, a row header in JetStream's own `Nats-*` namespace, a subject header
/// missing. Everything else (no stream, a timeout, a lost connection, a stream
/// that does not match [`NatsSink::expected_stream`]) is [`SinkError::Unavailable`].
///
/// Header values travel as stored, but NATS headers follow the MIME header format, whose
/// readers trim white space around a value: async-nats (and the Go client) hand a consumer
/// `" padded "` as `"padded"`, and drop trailing control characters. Keep meaningful
/// leading or trailing white space out of header values, or put such data in the payload.
pub fn nats(jetstream: async_nats::jetstream::Context, subject: Subject) -> NatsSink {
    NatsSink {
        jetstream,
        subject,
        expected_stream: None,
    }
}

impl NatsSink {
    /// Publishes with `Nats-Expected-Stream: stream`: the server refuses a message whose
    /// subject belongs to another stream, so a stream reconfigured by mistake pauses the
    /// relay instead of filling the wrong stream. A stream name is not empty and has no
    /// whitespace, `.`, `*`, `>`, `/` or `\` (checked when the relay is registered).
    pub fn expected_stream(mut self, stream: impl Into<String>) -> Self {
        self.expected_stream = Some(stream.into());
        self
    }
}

/// A JetStream API error the message itself caused.
fn message_fault(code: ErrorCode) -> bool {
    matches!(
        code,
        ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM
            | ErrorCode::STREAM_WRONG_LAST_MESSAGE_ID
            | ErrorCode::STREAM_WRONG_LAST_SEQUENCE
    )
}

fn classify(e: &async_nats::jetstream::context::PublishError) -> SinkError {
    let api = e
        .source()
        .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>());
    let text = match api {
        Some(api) => format!("{} ({api})", e.kind()),
        None => e.to_string(),
    };
    match e.kind() {
        PublishErrorKind::MaxPayloadExceeded
        | PublishErrorKind::WrongLastMessageId
        | PublishErrorKind::WrongLastSequence => SinkError::Rejected(text),
        PublishErrorKind::Other if api.is_some_and(|a| message_fault(a.error_code())) => {
            SinkError::Rejected(text)
        }
        _ => SinkError::Unavailable(text),
    }
}

impl Sink for NatsSink {
    fn publish(&self, message: BrokerMessage) -> BoxFuture<'static, Result<(), SinkError>> {
        let jetstream = self.jetstream.clone();
        let subject = self.subject.render(&message);
        let expected_stream = self.expected_stream.clone();
        Box::pin(async move {
            let subject = subject.map_err(SinkError::Rejected)?;
            let mut headers = HeaderMap::new();
            for (name, value) in &message.headers {
                // JetStream reads `Nats-*` headers as instructions (expected stream, last
                // sequence, rollup, TTL …): a row must not steer the stream, and such a
                // header's failure would look like an outage and hold the row for ever.
                if name.len() >= 5 && name[..5].eq_ignore_ascii_case("nats-") {
                    return Err(SinkError::Rejected(format!(
                        "header `{name}` is a JetStream control header (`Nats-*`); the relay sets `Nats-Msg-Id` itself"
                    )));
                }
                // async-nats would turn a line break into a space: refuse rather than alter.
                if value.contains(['\r', '\n']) {
                    return Err(SinkError::Rejected(format!(
                        "header `{name}` holds a line break, which a NATS header cannot carry"
                    )));
                }
                let name: async_nats::HeaderName = name.parse().map_err(|_| {
                    SinkError::Rejected(format!("header name `{name}` cannot be a NATS header"))
                })?;
                headers.insert(name, value.as_str());
            }
            let mut publish = PublishMessage::build()
                .payload(message.payload.into())
                .headers(headers)
                .message_id(&message.message_id);
            if let Some(stream) = expected_stream {
                publish = publish.expected_stream(stream);
            }
            let ack = jetstream
                .send_publish(subject, publish)
                .await
                .map_err(|e| classify(&e))?;
            let ack = ack.await.map_err(|e| classify(&e))?;
            if ack.duplicate {
                // Expected after a relay stopped between the confirm and the ack's commit;
                // anything else (two sources sharing message ids) shows up here.
                tracing::info!(
                    message_id = %message.message_id,
                    stream = %ack.stream,
                    "the stream already held this message id: stored nothing, acked as a duplicate"
                );
            }
            Ok(())
        })
    }

    fn check_queue(&self, queue: &str) -> Result<(), String> {
        check_subject(&self.subject.base(queue))
    }

    fn check(&self) -> Result<(), String> {
        self.subject.check()?;
        if let Some(stream) = &self.expected_stream {
            // NATS' rule for stream names (they name files on the server).
            if stream.is_empty()
                || stream.chars().any(|c| {
                    c.is_whitespace() || c.is_control() || matches!(c, '.' | '*' | '>' | '/' | '\\')
                })
            {
                return Err(format!(
                    "`expected_stream`: `{stream}` is not a stream name (not empty; no whitespace, `.`, `*`, `>`, `/` or `\\`)"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(queue: &str, headers: &[(&str, &str)]) -> BrokerMessage {
        let headers = headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        BrokerMessage::new(queue, 1, None, "t:1:1".to_owned(), vec![], headers)
    }

    #[test]
    fn subjects_from_a_fixed_name_the_queue_and_a_header() {
        let m = message("orders", &[("tenant", "eu")]);
        assert_eq!(Subject::fixed("a.b").render(&m).unwrap(), "a.b");
        assert_eq!(
            Subject::from_queue("outbox.").render(&m).unwrap(),
            "outbox.orders"
        );
        let by_tenant = Subject::from_queue("outbox.").with_header("tenant");
        assert_eq!(by_tenant.render(&m).unwrap(), "outbox.orders.eu");
        let missing = by_tenant.render(&message("orders", &[])).unwrap_err();
        assert!(missing.contains("`tenant`"), "{missing}");
        let bad = by_tenant
            .render(&message("orders", &[("tenant", "e u")]))
            .unwrap_err();
        assert!(bad.contains("not a subject token"), "{bad}");
        assert!(check_subject("outbox.my queue").is_err());
        assert!(check_subject("outbox..q").is_err());
        assert!(check_subject("outbox.q>").is_err());
        assert!(check_subject("outbox.presence.expiry").is_ok());
    }

    #[test]
    fn subject_settings_are_checked_whatever_the_queue() {
        assert!(Subject::from_queue("").check().is_ok());
        assert!(Subject::from_queue("a.b.").check().is_ok());
        let no_dot = Subject::from_queue("events").check().unwrap_err();
        assert!(no_dot.contains("must end in `.`"), "{no_dot}");
        assert!(Subject::from_queue("a..").check().is_err());
        assert!(Subject::from_queue("a.*.").check().is_err());
        assert!(Subject::fixed("").check().is_err());
        assert!(Subject::fixed("a.>").check().is_err());
        assert!(Subject::fixed("a b").check().is_err());
        assert!(Subject::fixed("a").with_header("").check().is_err());
        assert!(Subject::fixed("a").with_header("ten ant").check().is_err());
        assert!(Subject::fixed("a").with_header("tenant").check().is_ok());
    }
}
