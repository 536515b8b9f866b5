//! The README's quick start is the program `cargo run -p outbox --example quickstart` runs:
//! its Rust blocks (the code, then its `main`) must appear, verbatim, in
//! `outbox/examples/quickstart.rs` (which CI runs against Postgres), so the README cannot
//! drift from code that works. And the README is the crate's page on crates.io, which
//! resolves relative links against the crate's directory: every link is absolute.

use std::path::Path;

fn read(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The bodies of the ```rust blocks of the `## Quick start` section.
fn quick_start_blocks(readme: &str) -> Vec<String> {
    let section = readme
        .split_once("\n## Quick start\n")
        .expect("README.md has a `## Quick start` heading")
        .1;
    let section = section.split("\n## ").next().unwrap();
    let mut blocks = Vec::new();
    let mut lines = section.lines();
    while lines.by_ref().any(|l| l.starts_with("```rust")) {
        let body: Vec<&str> = lines
            .by_ref()
            .take_while(|l| l.trim_end() != "```")
            .collect();
        assert!(
            !body.is_empty(),
            "an empty ```rust block under `## Quick start`"
        );
        blocks.push(body.join("\n"));
    }
    assert!(
        !blocks.is_empty(),
        "no ```rust block under `## Quick start`"
    );
    blocks
}

#[test]
fn the_quick_start_is_the_example_verbatim() {
    let example = read("outbox/examples/quickstart.rs");
    let blocks = quick_start_blocks(&read("README.md"));
    assert_eq!(
        blocks.len(),
        2,
        "the quick start is its code and its `main`"
    );
    for block in blocks {
        check_contained(&block, "outbox/examples/quickstart.rs");
    }
    // Together they are the whole example, after its header comment.
    let code_start = example.find("\nuse ").expect("the example's first `use`") + 1;
    let together: String = quick_start_blocks(&read("README.md")).join("\n\n");
    assert_eq!(example[code_start..].trim_end(), together.trim_end());
}

/// Panics, naming the first line that differs, unless `block` (from the README) is in the
/// file `path`.
fn check_contained(block: &str, path: &str) {
    let example = read(path);
    if !example.contains(block) {
        // Point at the first line that differs, not at a 150-line blob.
        let first_missing = block
            .lines()
            .enumerate()
            .find(|(_, l)| !example.lines().any(|e| e == *l))
            .map_or_else(
                || "every line is there, in another order or with other lines between".to_owned(),
                |(i, l)| format!("block line {}: {l:?}", i + 1),
            );
        panic!(
            "a README.md block is not contained verbatim in {path}; copy one into the other \
             (formatted by rustfmt). First difference: {first_missing}"
        );
    }
}

#[test]
fn every_link_of_the_readme_is_absolute() {
    let readme = read("README.md");
    let relative: Vec<&str> = readme
        .split("](")
        .skip(1)
        .map(|rest| rest.split(')').next().unwrap())
        .filter(|target| !target.starts_with("https://") && !target.starts_with('#'))
        .collect();
    assert!(
        relative.is_empty(),
        "crates.io resolves these against the crate's directory, where they break; use \
         https://github.com/outbox-rs/outbox/blob/main/…: {relative:?}"
    );
}

/// The body of the first ```rust block of the README's section `heading` (`## …`).
fn first_rust_block(readme: &str, heading: &str) -> String {
    let section = readme
        .split_once(&format!("\n## {heading}\n"))
        .unwrap_or_else(|| panic!("README.md has a `## {heading}` section"))
        .1;
    let section = section.split("\n## ").next().unwrap();
    let mut lines = section.lines();
    lines
        .by_ref()
        .find(|l| l.starts_with("```rust"))
        .unwrap_or_else(|| panic!("a ```rust block in `## {heading}`"));
    let block: Vec<&str> = lines.take_while(|l| l.trim_end() != "```").collect();
    block.join("\n")
}

#[test]
fn the_testing_example_is_a_test_that_runs() {
    let block = first_rust_block(
        &read("README.md"),
        "Testing your handlers without a database",
    );
    check_contained(&block, "tests/integration/tests/it/docs/testing_example.rs");
}

/// The periodic example is compiled as a doc test (with the rest of the README) and run
/// in virtual time in `docs::periodic_example`, whose checks are what the section says.
#[test]
fn the_periodic_example_is_a_test_that_runs() {
    let block = first_rust_block(&read("README.md"), "Periodic timers");
    assert!(block.contains("every = \"5m\"") && block.contains("Recurrence::cron("));
    check_contained(
        &block,
        "tests/integration/tests/it/docs/periodic_example.rs",
    );
}

/// Found by a trial run: the README's list of metrics had fallen behind the ones the
/// runtime describes (`outbox/src/telemetry.rs` names each in a `describe_*!` call).
#[test]
fn the_readme_names_every_metric_the_runtime_describes() {
    let readme = read("README.md");
    let telemetry = read("outbox/src/telemetry.rs");
    let mut described = Vec::new();
    for piece in telemetry.split("describe_").skip(1) {
        // `counter!(\n "outbox_…",` — the first string literal after the macro name.
        if let Some(name) = piece.split('"').nth(1) {
            if name.starts_with("outbox_") {
                described.push(name.to_owned());
            }
        }
    }
    assert!(described.len() >= 15, "{described:?}");
    let missing: Vec<&String> = described
        .iter()
        .filter(|m| !readme.contains(&format!("`{m}")))
        .collect();
    assert!(missing.is_empty(), "the README does not name {missing:?}");
}
