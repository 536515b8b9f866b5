//! The runtime crate's public surface: the crate root holds what the quick start
//! types and nothing else, every public item has exactly one path, and rustdoc does not send
//! docs.rs readers to a specification they do not have.
//!
//! Read from the source, so a new `pub use` at the root, a second path to an item, or a
//! "SPEC §" in a doc comment fails here with the line that did it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../outbox/src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every `pub use …;` statement of a file (not `pub(crate) use`), joined onto one line.
fn pub_uses(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let trimmed = line.trim();
        if current.is_none() && trimmed.starts_with("pub use ") {
            current = Some(String::new());
        }
        if let Some(stmt) = current.as_mut() {
            stmt.push_str(trimmed);
            stmt.push(' ');
            if trimmed.ends_with(';') {
                out.push(current.take().unwrap());
            }
        }
    }
    out
}

/// The names a `pub use` statement brings in (the last segment of each path, or its alias).
fn names(stmt: &str) -> Vec<String> {
    let body = stmt
        .trim()
        .trim_start_matches("pub use ")
        .trim_end_matches(';');
    let inner = match body.find('{') {
        Some(open) => &body[open + 1..body.rfind('}').unwrap()],
        None => body,
    };
    inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|item| {
            let item = item.split(" as ").last().unwrap();
            item.rsplit("::").next().unwrap().trim().to_owned()
        })
        .collect()
}

const ROOT: [&str; 22] = [
    "Cancelled",
    "Context",
    "Error",
    "FromRef",
    "HandlerOptions",
    "HandlerTransaction",
    "Message",
    "Outbox",
    "OutboxBuilder",
    "Outcome",
    "PgStore",
    "Published",
    "Publisher",
    "Result",
    "RetryStrategy",
    "RunningWorker",
    "ShutdownReport",
    "Timer",
    "Worker",
    "WorkerBuilder",
    "migrate",
    "timer",
];

#[test]
fn the_crate_root_holds_the_quick_start_names_and_the_modules() {
    let lib = std::fs::read_to_string(src().join("lib.rs")).unwrap();
    let exported: BTreeSet<String> = pub_uses(&lib).iter().flat_map(|s| names(s)).collect();
    let want: BTreeSet<String> = ROOT.iter().map(|s| s.to_string()).collect();
    assert_eq!(
        exported, want,
        "the crate root's `pub use` names changed: a new name belongs in `message`, `schema`, \
         `stats`, `store`, `dlq`, `admin`, `periodic`, `relay`, `worker` or `testing` unless the quick start types it"
    );
    let modules: BTreeSet<&str> = lib
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub mod "))
        .map(|m| m.split(';').next().unwrap())
        .collect();
    assert_eq!(
        modules,
        BTreeSet::from([
            "__private",
            "admin",
            "dlq",
            "message",
            "periodic",
            "relay",
            "schema",
            "stats",
            "store",
            "telemetry",
            "testing",
            "worker"
        ])
    );
}

#[test]
fn every_public_item_has_one_path() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut seen: Vec<(String, String)> = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(src()).unwrap().display().to_string();
        let text = std::fs::read_to_string(file).unwrap();
        for stmt in pub_uses(&text) {
            for name in names(&stmt) {
                seen.push((name, rel.clone()));
            }
        }
        // A module other than the facades, made `pub`, would give its items a second path
        // (an empty one, `schema::upgrading`, only carries a page of docs).
        for line in text.lines() {
            let line = line.trim();
            if let Some(module) = line.strip_prefix("pub mod ") {
                assert!(
                    rel == "lib.rs" || module.ends_with("{}"),
                    "{rel}: `pub mod {module}` makes a second path to its items; use pub(crate)"
                );
            }
        }
    }
    // __private re-exports std and dependency items for the macro's expansion: not ours.
    seen.retain(|(_, file)| file != "__private.rs");
    // One file may name an item twice in two namespaces (the `FromRef` derive and trait).
    seen.sort();
    seen.dedup();
    let mut by_name = std::collections::BTreeMap::<&str, Vec<&str>>::new();
    for (name, file) in &seen {
        by_name.entry(name).or_default().push(file);
    }
    let doubled: Vec<_> = by_name
        .iter()
        .filter(|(_, files)| files.len() > 1)
        .collect();
    assert!(
        doubled.is_empty(),
        "re-exported from more than one place (two public paths): {doubled:?}"
    );
}

#[test]
fn rustdoc_states_its_rules_instead_of_citing_the_spec() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    rust_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("../../outbox-macros/src"),
        &mut files,
    );
    let mut citations = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim_start();
            let doc = line.starts_with("///") || line.starts_with("//!");
            if doc && (line.contains("SPEC") || line.contains('§')) {
                citations.push(format!("{}:{}: {line}", file.display(), n + 1));
            }
        }
    }
    assert!(
        citations.is_empty(),
        "doc comments cite the specification, which docs.rs readers do not have; state the \
         rule instead:\n{}",
        citations.join("\n")
    );
}
