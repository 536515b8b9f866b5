//! A process whose `metrics` recorder was installed before the service's: `install` gives
//! way (no panic, no second recorder) and says so by returning `None`, every time; the
//! service then answers `GET /metrics` with 404 and leaves the metric fields of `/stats`
//! empty. Its own test binary, so the recorder installed here touches no other test.

#[test]
fn install_gives_way_to_a_recorder_installed_first() {
    metrics::set_global_recorder(metrics::NoopRecorder).expect("the first recorder");
    assert!(presence::telemetry::install().is_none());
    assert!(presence::telemetry::install().is_none(), "decided once");
}
