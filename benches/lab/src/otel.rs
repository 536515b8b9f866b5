//! Feature `opentelemetry`: a global subscriber whose `tracing-opentelemetry` layer turns
//! the runtime's `INFO` spans into OpenTelemetry spans, handed to a batch span processor
//! (the SDK's default for production) with an exporter that counts and drops them. So a run
//! pays for the spans, their attributes, the trace context written into every published
//! row and read back at delivery, and the processor's queue, but not for a network
//! exporter (which depends on the collector, not on this crate).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;

/// Counts the spans it is given and drops them.
#[derive(Debug, Clone, Default)]
struct Discard(Arc<AtomicU64>);

impl SpanExporter for Discard {
    fn export(
        &self,
        batch: Vec<SpanData>,
    ) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        self.0.fetch_add(batch.len() as u64, Ordering::Relaxed);
        std::future::ready(Ok(()))
    }
}

/// The installed pipeline; [`Otel::finish`] flushes it and says how many spans it saw.
pub struct Otel {
    provider: SdkTracerProvider,
    exported: Arc<AtomicU64>,
}

/// Installs the subscriber as the process's global default.
pub fn install() -> Otel {
    let exporter = Discard::default();
    let exported = exporter.0.clone();
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-lab"));
    let subscriber = tracing_subscriber::registry()
        .with(LevelFilter::INFO)
        .with(layer);
    tracing::subscriber::set_global_default(subscriber)
        .expect("no other global subscriber in the harness");
    eprintln!(
        "outbox-lab: feature opentelemetry: INFO spans go through tracing-opentelemetry to a \
         batch processor whose exporter drops them; rows carry the trace context"
    );
    Otel { provider, exported }
}

impl Otel {
    pub fn finish(self) {
        let _ = self.provider.force_flush();
        eprintln!(
            "outbox-lab: feature opentelemetry: {} spans exported (and dropped)",
            self.exported.load(Ordering::Relaxed)
        );
        let _ = self.provider.shutdown();
    }
}
