// A worker dropped by mistake is a warning (an error under `deny(unused_must_use)`), with a
// message that says what is lost: a builder never built, a worker never started, and a
// started worker whose handle is dropped (which starts its shutdown).
#![deny(unused_must_use)]

fn wire(store: outbox::PgStore) -> Result<(), outbox::Error> {
    outbox::Worker::builder(store.clone()).concurrency(4);
    outbox::Worker::builder(store.clone()).build()?;
    outbox::Worker::builder(store).build()?.start();
    Ok(())
}

fn main() {}
