//! Printing: a table for people, JSON for scripts. Everything the commands print on stdout
//! goes through [`line`] and [`raw`], which end the process quietly (status 0) when the
//! reader has gone (`outbox status --watch | head`), rather than panicking as `println!`
//! does on a closed pipe.

use std::fmt::Display;
use std::io::{ErrorKind, Write};

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

/// `text` and a newline on stdout, its control characters escaped ([`terminal_safe`]).
pub fn line(text: impl Display) {
    let text = text.to_string();
    let mut out = std::io::stdout().lock();
    let written = writeln!(out, "{}", terminal_safe(&text)).and_then(|()| out.flush());
    done_or_exit(written);
}

/// `text` on stdout (no newline), its control characters escaped ([`terminal_safe`]),
/// flushed.
pub fn raw(text: &str) {
    let mut out = std::io::stdout().lock();
    let written = out
        .write_all(terminal_safe(text).as_bytes())
        .and_then(|()| out.flush());
    done_or_exit(written);
}

/// `text` with every control character but the line break written as its Rust escape
/// (`\u{1b}`, `\r`, `\0`): queue names, timer ids, headers and payloads are data, often an
/// end user's, and an escape sequence among them must not reach the operator's terminal
/// (clear the screen, set the window title). JSON output is unaffected: JSON escapes
/// control characters itself.
pub fn terminal_safe(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(|c| c.is_control() && c != '\n') {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() && c != '\n' {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// A name from the data (a queue, a timer id) as text and table cells show it: as it is,
/// or quoted with Rust's escapes when it is empty, starts or ends with white space, or
/// holds a control character (a line break among them), so that ` sp ` and `sp` look
/// different and no name forges a line of output.
pub fn name(s: &str) -> std::borrow::Cow<'_, str> {
    let plain = !s.is_empty()
        && !s.starts_with(char::is_whitespace)
        && !s.ends_with(char::is_whitespace)
        && !s.chars().any(char::is_control);
    if plain {
        std::borrow::Cow::Borrowed(s)
    } else {
        std::borrow::Cow::Owned(format!("{s:?}"))
    }
}

/// A closed pipe means the reader has what it wanted: exit 0 without a word. Any other write
/// error ends the process with status 1 and the reason.
fn done_or_exit(written: std::io::Result<()>) {
    match written {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => {
            eprintln!("error: cannot write to stdout: {e}");
            std::process::exit(1);
        }
    }
}

/// One JSON document on its own line.
pub fn json(value: &Value) {
    line(value);
}

/// A time as RFC 3339 in UTC, to the millisecond.
pub fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// An optional time, `-` when absent.
pub fn maybe_time(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(|| "-".to_owned(), time)
}

/// Text cut to 80 characters (the 80th an ellipsis when cut).
pub fn cut(s: &str) -> String {
    if s.chars().count() <= 80 {
        s.to_owned()
    } else {
        format!("{}…", s.chars().take(79).collect::<String>())
    }
}

/// A one-line cell: runs of whitespace (newlines included) become one space, cut to 80
/// characters.
pub fn one_line(s: &str) -> String {
    cut(&s.split_whitespace().collect::<Vec<_>>().join(" "))
}

/// A payload for a person: the text when it is UTF-8 (cut to 80 characters), else its size.
pub fn payload(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => cut(s),
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

/// The payload in lowercase hex when it is not UTF-8 (what `payload_json` leaves null), else
/// null.
pub fn payload_hex(bytes: &[u8]) -> Value {
    if std::str::from_utf8(bytes).is_ok() {
        return Value::Null;
    }
    let mut hex = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        hex.push_str(&format!("{b:02x}"));
    }
    Value::String(hex)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_are_one_line_and_cut() {
        assert_eq!(one_line("a\n  b\tc "), "a b c");
        let long = one_line(&"x ".repeat(100));
        assert_eq!(long.chars().count(), 80);
        assert!(long.ends_with('…'));
        assert_eq!(payload_hex(&[0xff, 0x00, 0x1a]), "ff001a");
        assert_eq!(payload_hex(b"text"), Value::Null);
    }

    #[test]
    fn names_that_would_look_alike_or_forge_a_line_are_quoted() {
        assert_eq!(name("emails"), "emails");
        assert_eq!(name("two words"), "two words");
        assert_eq!(name(" sp "), "\" sp \"");
        assert_eq!(name(""), "\"\"");
        assert_eq!(name("a\nfake | line"), "\"a\\nfake | line\"");
        assert_eq!(name("esc\u{1b}[31m"), "\"esc\\u{1b}[31m\"");
    }

    #[test]
    fn control_characters_never_reach_the_terminal() {
        assert_eq!(
            terminal_safe("esc\u{1b}]0;pwned\u{7} title\r\nnext\u{9b}"),
            "esc\\u{1b}]0;pwned\\u{7} title\\r\nnext\\u{9b}"
        );
        assert!(matches!(
            terminal_safe("plain\ntext"),
            std::borrow::Cow::Borrowed(_)
        ));
    }
}
