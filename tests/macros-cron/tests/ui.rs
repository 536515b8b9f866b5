//! Compile-fail tests of the `cron` and `tz` arguments of `#[timer]` with the `cron`
//! feature on (issue 17 req 3): each error is spanned at the string that causes it.
//! Regenerate with `TRYBUILD=overwrite cargo test -p outbox-macro-cron-tests --test ui`,
//! then read every changed `.stderr`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
