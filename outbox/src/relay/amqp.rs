//! The AMQP 0-9-1 sink (feature `relay-amqp`, on lapin): RabbitMQ and other AMQP brokers,
//! on a channel in publisher-confirm mode.

use std::sync::Arc;

use futures::future::BoxFuture;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ErrorKind};
use tokio::sync::Mutex;

use super::{BrokerMessage, Sink, SinkError};

/// The routing key of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RoutingKey {
    /// Every message with this key.
    Fixed(String),
    /// The queue name.
    Queue,
    /// The value of this message header; a message without it is rejected (retried, then
    /// dead-lettered with the reason).
    Header(String),
}

/// The AMQP sink: built by [`amqp`], configured with [`AmqpSink::routing_key`],
/// [`AmqpSink::persistent`] and [`AmqpSink::mandatory`].
#[derive(Clone)]
pub struct AmqpSink {
    uri: String,
    exchange: String,
    routing_key: RoutingKey,
    persistent: bool,
    mandatory: bool,
    /// The connection and its confirm-mode channel, opened on first use and again after a
    /// failure.
    channel: Arc<Mutex<Option<(Connection, Channel)>>>,
}

impl std::fmt::Debug for AmqpSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpSink")
            .field("exchange", &self.exchange)
            .field("routing_key", &self.routing_key)
            .field("persistent", &self.persistent)
            .field("mandatory", &self.mandatory)
            .finish_non_exhaustive()
    }
}

/// A relay to an AMQP 0-9-1 broker (RabbitMQ) at `uri` (`amqp://user:pass@host:5672/vhost`),
/// publishing to `exchange` (`""` is the default exchange, which routes by queue name) with
/// the queue name as routing key unless set otherwise ([`AmqpSink::routing_key`]).
///
/// The sink opens one connection and one channel in publisher-confirm mode on first use,
/// and opens them again after a failure (a lost connection, a closed channel), so a broker
/// that comes back is used again without a restart. Each message is published with
/// `message_id` = the row's message id, the row's headers as AMQP headers (long strings),
/// `delivery_mode` 2 (persistent) and the `mandatory` flag unless turned off, and
/// completes when the broker's confirm for it arrives. TLS (`amqps://`) needs lapin's
/// `rustls` or `native-tls` feature, enabled on your own `lapin` dependency.
///
/// What counts as the message's fault ([`SinkError::Rejected`]): a `basic.return` (no
/// queue bound for its routing key, with `mandatory`), a nack, a routing header missing,
/// and a channel the broker closes because of the message (406 `PRECONDITION_FAILED` for
/// a message larger than its `max_message_size`, naming this message's size). A
/// connection that cannot be opened or is lost, a channel closed for another reason (the
/// exchange does not exist) and a confirm that does not come are
/// [`SinkError::Unavailable`]. Opening the connection is bounded by the relay's
/// [`connect_timeout`](super::Relay::connect_timeout) (5 s by default), apart from its
/// publish timeout.
///
/// Checked when the relay is registered ([`Sink::check`], an
/// [`Error::InvalidConfig`](crate::Error::InvalidConfig) from the worker's `build()`): the
/// URI parses, the exchange name and a fixed routing key are at most 255 bytes, a header
/// routing key names a header, and on the default exchange (`""`, which routes by queue
/// name) the routing key is not empty and `mandatory` is on (without it a message whose
/// key names no queue would be dropped by the broker and its row deleted).
///
/// **Returned messages are logged by lapin with their payload.** lapin logs every
/// `basic.return` at WARN, target `lapin::returned_messages`, as the Debug form of the whole
/// returned message, body bytes included ("Server returned us a message"), as it reads the
/// frame, before the confirm hands the message to the sink: nothing the sink does with it
/// can prevent that line. The relay records the broker's reason (reply code and text, no
/// payload) in the row's `last_error`. If payloads may be sensitive, silence that target in
/// your subscriber, e.g. `RUST_LOG=info,lapin::returned_messages=error` with
/// `tracing_subscriber::EnvFilter` (or `.add_directive("lapin::returned_messages=error".parse()?)`).
pub fn amqp(uri: impl Into<String>, exchange: impl Into<String>) -> AmqpSink {
    AmqpSink {
        uri: uri.into(),
        exchange: exchange.into(),
        routing_key: RoutingKey::Queue,
        persistent: true,
        mandatory: true,
        channel: Arc::new(Mutex::new(None)),
    }
}

impl AmqpSink {
    /// The routing key (default [`RoutingKey::Queue`]).
    pub fn routing_key(mut self, key: RoutingKey) -> Self {
        self.routing_key = key;
        self
    }

    /// `delivery_mode` 2, kept across a broker restart by durable queues (default `true`).
    pub fn persistent(mut self, on: bool) -> Self {
        self.persistent = on;
        self
    }

    /// Publishes with `mandatory` (default `true`): a message no queue is bound for comes
    /// back, and the relay retries and dead-letters it instead of the broker dropping it.
    pub fn mandatory(mut self, on: bool) -> Self {
        self.mandatory = on;
        self
    }

    /// The channel, opening the connection and the channel when there is none or it closed.
    async fn channel(&self) -> Result<Channel, SinkError> {
        let mut slot = self.channel.lock().await;
        if let Some((_, channel)) = slot.as_ref() {
            if channel.status().connected() {
                return Ok(channel.clone());
            }
        }
        *slot = None;
        // Bounded by the relay's connect timeout (`Sink::connect`), or by the publish timeout
        // when a publish finds the channel gone.
        let connection = Connection::connect(&self.uri, ConnectionProperties::default())
            .await
            .map_err(|e| SinkError::Unavailable(format!("cannot connect: {e}")))?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| SinkError::Unavailable(format!("cannot open a channel: {e}")))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| SinkError::Unavailable(format!("confirm.select failed: {e}")))?;
        *slot = Some((connection, channel.clone()));
        Ok(channel)
    }

    /// Forgets a failed channel (if it is still the current one), so the next publish opens
    /// a new one.
    async fn discard(&self, failed: &Channel) {
        let mut slot = self.channel.lock().await;
        if slot.as_ref().is_some_and(|(_, c)| c.id() == failed.id()) {
            *slot = None;
        }
    }

    fn key(&self, message: &BrokerMessage) -> Result<String, String> {
        match &self.routing_key {
            RoutingKey::Fixed(k) => Ok(k.clone()),
            RoutingKey::Queue => Ok(message.queue.clone()),
            RoutingKey::Header(name) => message.headers.get(name).cloned().ok_or_else(|| {
                format!("the routing key is the header `{name}`, which the message does not have")
            }),
        }
    }
}

/// Whether the broker closed the channel because of this message: 406
/// `PRECONDITION_FAILED` "message size N is larger than configured max size M" with N this
/// message's body size (RabbitMQ's answer to a message above `max_message_size`). Counted
/// as an outage, such a message was given back and tried again forever, and its queue
/// relayed nothing else (found by a fresh user). The other messages in flight on the
/// channel fail with the same close, naming another size: for them it stays an outage
/// (given back uncounted, sent again on a new channel).
fn refused_message(e: &lapin::Error, body: usize) -> bool {
    let ErrorKind::ProtocolError(amqp) = e.kind() else {
        return false;
    };
    matches!(
        amqp.kind(),
        AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)
    ) && amqp
        .get_message()
        .as_str()
        .contains(&format!("message size {body} "))
}

impl Sink for AmqpSink {
    fn publish(&self, message: BrokerMessage) -> BoxFuture<'static, Result<(), SinkError>> {
        let me = self.clone();
        Box::pin(async move {
            let key = me.key(&message).map_err(SinkError::Rejected)?;
            let body = message.payload.len();
            if key.len() > 255 {
                return Err(SinkError::Rejected(format!(
                    "the routing key is {} bytes; AMQP allows 255",
                    key.len()
                )));
            }
            let mut headers = FieldTable::default();
            for (name, value) in &message.headers {
                if name.len() > 255 {
                    return Err(SinkError::Rejected(format!(
                        "a header name of {} bytes; AMQP allows 255",
                        name.len()
                    )));
                }
                headers.insert(
                    ShortString::from(name.as_str()),
                    AMQPValue::LongString(LongString::from(value.as_bytes())),
                );
            }
            let mut properties = BasicProperties::default()
                .with_message_id(ShortString::from(message.message_id.as_str()))
                .with_headers(headers);
            if me.persistent {
                properties = properties.with_delivery_mode(2);
            }
            let options = BasicPublishOptions {
                mandatory: me.mandatory,
                ..BasicPublishOptions::default()
            };
            let channel = me.channel().await?;
            let confirm = match channel
                .basic_publish(
                    ShortString::from(me.exchange.as_str()),
                    ShortString::from(key),
                    options,
                    &message.payload,
                    properties,
                )
                .await
            {
                Ok(confirm) => confirm,
                Err(e) => {
                    me.discard(&channel).await;
                    if refused_message(&e, body) {
                        return Err(SinkError::Rejected(format!("refused by the broker: {e}")));
                    }
                    return Err(SinkError::Unavailable(format!("basic.publish failed: {e}")));
                }
            };
            match confirm.await {
                Ok(Confirmation::Ack(None)) => Ok(()),
                Ok(Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned))) => {
                    Err(SinkError::Rejected(format!(
                        "returned by the broker: {} {}",
                        returned.reply_code, returned.reply_text
                    )))
                }
                Ok(Confirmation::Nack(None)) => Err(SinkError::Rejected(
                    "the broker nacked the message".to_owned(),
                )),
                Ok(Confirmation::NotRequested) => {
                    me.discard(&channel).await;
                    Err(SinkError::Unavailable(
                        "the channel is not in confirm mode".to_owned(),
                    ))
                }
                Err(e) => {
                    me.discard(&channel).await;
                    if refused_message(&e, body) {
                        return Err(SinkError::Rejected(format!("refused by the broker: {e}")));
                    }
                    Err(SinkError::Unavailable(format!("no confirm: {e}")))
                }
            }
        })
    }

    fn connect(&self) -> BoxFuture<'static, Result<(), SinkError>> {
        let me = self.clone();
        Box::pin(async move { me.channel().await.map(drop) })
    }

    fn check_queue(&self, queue: &str) -> Result<(), String> {
        if matches!(self.routing_key, RoutingKey::Queue) && queue.len() > 255 {
            return Err("a routing key holds at most 255 bytes".to_owned());
        }
        Ok(())
    }

    fn check(&self) -> Result<(), String> {
        if self.uri.trim().is_empty() {
            return Err(
                "the AMQP URI is empty (`amqp://user:pass@host:port/vhost` expected)".to_owned(),
            );
        }
        if let Err(e) = self.uri.parse::<lapin::uri::AMQPUri>() {
            // The parser's text may quote the URI, password and all.
            let e = e.replace(&self.uri, "…");
            return Err(format!(
                "the AMQP URI does not parse (`amqp://user:pass@host:port/vhost` expected): {e}"
            ));
        }
        if self.exchange.len() > 255 {
            return Err(format!(
                "the exchange name is {} bytes; AMQP allows 255",
                self.exchange.len()
            ));
        }
        let default_exchange = self.exchange.is_empty();
        match &self.routing_key {
            RoutingKey::Queue => {}
            RoutingKey::Fixed(k) if k.len() > 255 => {
                return Err(format!(
                    "the routing key is {} bytes; AMQP allows 255",
                    k.len()
                ))
            }
            RoutingKey::Fixed(k) if k.is_empty() && default_exchange => {
                return Err(
                    "an empty routing key on the default exchange (`\"\"`) names no queue: every message would come back"
                        .to_owned(),
                )
            }
            RoutingKey::Fixed(_) => {}
            RoutingKey::Header(name) if name.is_empty() || name.len() > 255 => {
                return Err("`RoutingKey::Header` needs a header name of 1..=255 bytes".to_owned())
            }
            RoutingKey::Header(_) => {}
        }
        if default_exchange && !self.mandatory {
            // The default exchange routes by queue name: a key that names no queue (a typo, a
            // queue not declared yet) would be dropped by the broker and the row deleted.
            return Err(
                "`mandatory(false)` on the default exchange (`\"\"`) would lose every message whose routing key names no queue; keep `mandatory` on, or publish to a named exchange"
                    .to_owned(),
            );
        }
        Ok(())
    }
}
