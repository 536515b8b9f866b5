//! Printing: a table for people, JSON for scripts.

use chrono::{DateTime, SecondsFormat, Utc};
use comfy_table::{presets::UTF8_FULL_CONDENSED, ContentArrangement, Table};
use serde_json::Value;

/// A table with `header`, laid out for the terminal.
pub fn table(header: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_header(header.iter().copied());
    t
}

/// One JSON document on its own line.
pub fn json(value: &Value) {
    println!("{value}");
}

/// A time as RFC 3339 in UTC, to the millisecond.
pub fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// An optional time, `-` when absent.
pub fn maybe_time(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(|| "-".to_owned(), time)
}

/// A payload for a person: the text when it is UTF-8, else its size.
pub fn payload(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) if s.chars().count() <= 80 => s.to_owned(),
        Ok(s) => format!("{}…", s.chars().take(79).collect::<String>()),
        Err(_) => format!("<{} bytes, not UTF-8>", bytes.len()),
    }
}

/// A payload for JSON: the text when it is UTF-8, else null (with the size beside it).
pub fn payload_json(bytes: &[u8]) -> Value {
    match std::str::from_utf8(bytes) {
        Ok(s) => Value::String(s.to_owned()),
        Err(_) => Value::Null,
    }
}
