// A handler asks its context for a piece of state the worker was not given: a compile
// error that says so and how to give it (SPEC §7.10).

#[derive(Clone, outbox::FromRef)]
struct AppState {
    greeting: std::sync::Arc<str>,
}

async fn on_job(_: Vec<u8>, ctx: outbox::Context<AppState>) {
    let _greeting = ctx.state::<std::sync::Arc<str>>();
    let _missing = ctx.state::<u64>();
}

async fn without_state(_: Vec<u8>, ctx: outbox::Context) {
    let _missing = ctx.state::<String>();
}

fn wire(store: outbox::PgStore) {
    let _ = outbox::Worker::builder(store.clone())
        .state(AppState { greeting: "hi".into() })
        .queue("jobs", on_job);
    let _ = outbox::Worker::builder(store).queue("other", without_state);
}

fn main() {}
