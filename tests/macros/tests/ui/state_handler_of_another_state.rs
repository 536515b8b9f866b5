// A handler written for one state cannot be registered on a worker given another.

#[derive(Clone)]
struct AppState;

#[derive(Clone)]
struct OtherState;

async fn on_job(_: Vec<u8>, _ctx: outbox::Context<OtherState>) {}

fn wire(store: outbox::PgStore) {
    let _ = outbox::Worker::builder(store)
        .state(AppState)
        .queue("jobs", on_job);
}

fn main() {}
