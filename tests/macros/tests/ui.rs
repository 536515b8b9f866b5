//! Compile-fail tests of `#[timer]` (SPEC §9): one failure per file, named after it, with
//! the compiler's output checked in next to it. Regenerate with
//! `TRYBUILD=overwrite cargo test -p outbox-macro-tests --test ui`, then read every
//! changed `.stderr`: the message must be clear and the span on the offending token.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
