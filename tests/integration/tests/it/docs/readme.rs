//! The README's quick start is the program `cargo run -p outbox --example quickstart` runs:
//! its Rust blocks (the code, then its `main`) must appear, verbatim, in
//! `outbox/examples/quickstart.rs` (which CI runs against Postgres), so the README cannot
//! drift from code that works. And the README is the crate's page on crates.io, which
//! resolves relative links against the crate's directory: every link is absolute.
//!
//! The guide (`docs/guide/*.md`) is held to the same standard: its examples are tests that
//! run (periodic timers, testing); every link into the repository, from any page of the docs
//! or from the crates' sources, names a file and a heading that exist; and the metrics the
//! runtime describes are all named in the crate's docs.

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
        check_contained(&block, "README.md", "outbox/examples/quickstart.rs");
    }
    // Together they are the whole example, after its header comment.
    let code_start = example.find("\nuse ").expect("the example's first `use`") + 1;
    let together: String = quick_start_blocks(&read("README.md")).join("\n\n");
    assert_eq!(example[code_start..].trim_end(), together.trim_end());
}

/// Panics, naming the first line that differs, unless `block` (from the page `from`) is in
/// the file `path`.
fn check_contained(block: &str, from: &str, path: &str) {
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
            "a {from} block is not contained verbatim in {path}; copy one into the other \
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

/// The body of the first ```rust block of the section `heading` (`## …`) of `page`.
fn first_rust_block(page: &str, heading: &str) -> String {
    let text = read(page);
    let section = text
        .split_once(&format!("\n## {heading}\n"))
        .unwrap_or_else(|| panic!("{page} has a `## {heading}` section"))
        .1;
    let section = section.split("\n## ").next().unwrap();
    let mut lines = section.lines();
    lines
        .by_ref()
        .find(|l| l.starts_with("```rust"))
        .unwrap_or_else(|| panic!("a ```rust block in `## {heading}` of {page}"));
    let block: Vec<&str> = lines.take_while(|l| l.trim_end() != "```").collect();
    block.join("\n")
}

/// The page's first ```rust block, in a page whose example opens it (`# …` then prose).
fn first_rust_block_of_page(page: &str) -> String {
    let text = read(page);
    let mut lines = text.lines();
    lines
        .by_ref()
        .find(|l| l.starts_with("```rust"))
        .unwrap_or_else(|| panic!("a ```rust block in {page}"));
    let block: Vec<&str> = lines.take_while(|l| l.trim_end() != "```").collect();
    block.join("\n")
}

#[test]
fn the_testing_example_is_a_test_that_runs() {
    let block = first_rust_block_of_page("docs/guide/testing.md");
    assert!(block.contains("run_due") && block.contains("MemoryStore"));
    check_contained(
        &block,
        "docs/guide/testing.md",
        "tests/integration/tests/it/docs/testing_example.rs",
    );
}

/// The periodic example is compiled as a doc test (outbox's lib.rs includes the guide pages)
/// and run in virtual time in `docs::periodic_example`, whose checks are what the page says.
#[test]
fn the_periodic_example_is_a_test_that_runs() {
    let block = first_rust_block("docs/guide/periodic.md", "Declaring a schedule");
    assert!(block.contains("every = \"5m\"") && block.contains("Recurrence::cron("));
    check_contained(
        &block,
        "docs/guide/periodic.md",
        "tests/integration/tests/it/docs/periodic_example.rs",
    );
}

/// Every `.rs` file under `dir` (relative to the repository), recursively.
fn rust_files(dir: &str) -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut out = Vec::new();
    let mut stack = vec![root.join(dir)];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                out.push((path.display().to_string(), text));
            }
        }
    }
    out
}

/// Found by the issue-16 trial: the README's list of metrics had fallen behind the ones the
/// runtime describes. `outbox/src/telemetry.rs` writes each name once, as a constant of its
/// `name` module (the only string literals of that file's code that start with `outbox_`).
/// The list lives in the crate's docs (the `telemetry` module's table, the queue-depth gauge
/// on its builder method), which the guide links to: every described metric must be named in
/// a doc comment of the crate.
#[test]
fn the_crate_docs_name_every_metric_the_runtime_describes() {
    let files = rust_files("outbox/src");
    let telemetry = read("outbox/src/telemetry.rs");
    let mut described = Vec::new();
    for line in telemetry
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
    {
        // `pub(super) const ACKED: &str = "outbox_acked_total";`
        if let Some(name) = line.split('"').nth(1) {
            if name.starts_with("outbox_") {
                described.push(name.to_owned());
            }
        }
    }
    let mut docs = String::new();
    for (_, text) in &files {
        for line in text.lines() {
            let line = line.trim_start();
            if line.starts_with("//!") || line.starts_with("///") {
                docs.push_str(line);
                docs.push('\n');
            }
        }
    }
    assert!(described.len() >= 15, "{described:?}");
    let missing: Vec<&String> = described
        .iter()
        .filter(|m| !docs.contains(&format!("`{m}")))
        .collect();
    assert!(
        missing.is_empty(),
        "no doc comment of outbox names {missing:?}"
    );
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown file's headings (outside code blocks).
fn anchors(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.push(anchor(line.trim_start_matches('#')));
        }
    }
    out
}

/// The repository's own pages as GitHub serves them: links in the README (absolute, for
/// crates.io) and in the crates' docs and messages point here.
const REPO: [&str; 2] = [
    "https://github.com/outbox-rs/outbox/blob/main/",
    "https://github.com/outbox-rs/outbox/tree/main/",
];

/// Why `target`, linked from `page`, is broken, if it is: a relative path or a link into
/// the repository must name a file that exists and, after `#`, one of its headings. Other
/// absolute links (docs.rs, crates.io) are not fetched.
fn broken(page: &str, target: &str) -> Option<&'static str> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let (file, fragment) = target.split_once('#').unwrap_or((target, ""));
    let path = if let Some(rest) = REPO.iter().find_map(|r| file.strip_prefix(r)) {
        root.join(rest)
    } else if file.starts_with("https://") || file.starts_with("http://") {
        return None;
    } else if file.is_empty() {
        root.join(page)
    } else {
        root.join(page).parent().unwrap().join(file)
    };
    if !path.exists() {
        return Some("no such file");
    }
    if !fragment.is_empty() {
        let heads = anchors(&std::fs::read_to_string(&path).unwrap_or_default());
        if !heads.iter().any(|h| h == fragment) {
            return Some("no such heading");
        }
    }
    None
}

/// The docs link to each other by relative paths (GitHub resolves them against the page),
/// the README and the shipped upgrade guide by absolute ones: each names a file that exists
/// and, after `#`, one of that file's headings. So do the repository links in the crates'
/// sources (rustdoc, error messages).
#[test]
fn every_link_into_the_repository_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut pages = vec![
        "README.md".to_owned(),
        "CHANGELOG.md".to_owned(),
        "CONTRIBUTING.md".to_owned(),
        "ARCHITECTURE.md".to_owned(),
        "docs/benchmarks.md".to_owned(),
        "docs/faults.md".to_owned(),
        "docs/performance.md".to_owned(),
        "outbox/docs/upgrading.md".to_owned(),
        "outbox-cli/README.md".to_owned(),
        "outbox-ui/README.md".to_owned(),
        "examples/presence/README.md".to_owned(),
    ];
    for dir in ["docs/guide", "docs/lab-notes"] {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            if name.ends_with(".md") {
                pages.push(format!("{dir}/{name}"));
            }
        }
    }
    let mut bad = Vec::new();
    for page in &pages {
        let mut fenced = false;
        for line in read(page).lines() {
            if line.starts_with("```") {
                fenced = !fenced;
            }
            if fenced {
                continue;
            }
            for rest in line.split("](").skip(1) {
                let target = rest.split(')').next().unwrap();
                if let Some(why) = broken(page, target) {
                    bad.push(format!("{page}: {target} ({why})"));
                }
            }
        }
    }
    for dir in ["outbox/src", "outbox-cli/src", "outbox-ui/src"] {
        for (file, text) in rust_files(dir) {
            for rest in text.split(REPO[0]).skip(1) {
                let end = rest
                    .find(|c: char| c.is_whitespace() || "\"'>)`".contains(c))
                    .unwrap_or(rest.len());
                let target = format!("{}{}", REPO[0], &rest[..end]);
                if let Some(why) = broken("README.md", &target) {
                    bad.push(format!("{file}: {target} ({why})"));
                }
            }
        }
    }
    assert!(bad.is_empty(), "broken links: {bad:#?}");
}
