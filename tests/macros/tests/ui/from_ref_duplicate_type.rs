// Two fields of one type: a handler asking for that type would be ambiguous.

#[derive(Clone, outbox::FromRef)]
struct AppState {
    primary: std::sync::Arc<str>,
    replica: std::sync::Arc<str>,
}

fn main() {}
