//! How values are shown: times in UTC with a relative age, durations, counts, payloads and
//! the sparkline. Pure functions; every string they return is escaped by the page that
//! shows it.

use std::fmt::Write as _;

use chrono::{DateTime, Utc};
use maud::{html, Markup};
use outbox::stats::Count;

/// `2026-12-05 02:03:04 UTC`.
pub(crate) fn utc(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

/// `t` relative to `now`: "in 3 s", "12 min ago", "now".
pub(crate) fn relative(t: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let ms = (t - now).num_milliseconds();
    // To the nearest second: a deadline 4 min away, read a few ms later, is "in 4 min".
    let secs = (ms.abs() + 500) / 1000;
    if secs == 0 {
        return "now".to_owned();
    }
    let span = span(secs);
    if ms > 0 {
        format!("in {span}")
    } else {
        format!("{span} ago")
    }
}

/// A number of seconds in its two largest units, the second left out when zero: "3 s",
/// "4 min 5 s", "1 h 59 min", "2 d 3 h", "300 y" (a year is the Gregorian mean,
/// 365.2425 days), rounded down.
pub(crate) fn span(secs: i64) -> String {
    const YEAR: i64 = 31_556_952;
    const UNITS: [(i64, &str); 5] = [
        (YEAR, "y"),
        (86_400, "d"),
        (3600, "h"),
        (60, "min"),
        (1, "s"),
    ];
    let secs = secs.max(0);
    let i = UNITS.iter().position(|(n, _)| secs >= *n).unwrap_or(4);
    let (big, name) = UNITS[i];
    let mut out = format!("{} {name}", secs / big);
    if let Some((small, small_name)) = UNITS.get(i + 1) {
        let rest = secs % big / small;
        if rest > 0 {
            out.push_str(&format!(" {rest} {small_name}"));
        }
    }
    out
}

/// Seconds with a unit fit for lateness: "0.25 s", "12 s", "3 min".
pub(crate) fn seconds(s: f64) -> String {
    if s < 10.0 {
        format!("{s:.2} s")
    } else {
        span(s as i64)
    }
}

/// A statistic: exact, "≈" estimated, or "–" unavailable.
pub(crate) fn count(c: Count) -> String {
    match (c.value(), c.is_exact()) {
        (Some(v), true) => v.to_string(),
        (Some(v), false) => format!("≈{v}"),
        (None, _) => "–".to_owned(),
    }
}

/// A payload as shown: its stored text re-indented when the bytes are UTF-8 and parse as
/// JSON, else `None`. Never through `serde_json::Value`, which would round big numbers,
/// sort keys and drop duplicate ones: the text is [`indent`]ed as stored.
#[cfg(test)]
pub(crate) fn json(bytes: &[u8]) -> Option<String> {
    let text = json_text(bytes)?;
    Some(indent(text, usize::MAX).0)
}

/// The bytes as text when they are UTF-8 and one JSON value (checked by serde_json,
/// building nothing).
pub(crate) fn json_text(bytes: &[u8]) -> Option<&str> {
    let text = std::str::from_utf8(bytes).ok()?;
    serde_json::from_str::<serde::de::IgnoredAny>(text).ok()?;
    Some(text)
}

/// Valid JSON `text` re-indented (two spaces, `"key": value`, empty `{}` and `[]` kept
/// on one line) by its tokens alone: strings (escapes and all), numbers and literals are
/// copied verbatim, in their order; only the whitespace between tokens changes. Stops
/// once `max` bytes of `text` are read (at a character boundary); returns the text and
/// how many bytes of `text` it covers.
pub(crate) fn indent(text: &str, max: usize) -> (String, usize) {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len().min(max).saturating_mul(2));
    let mut depth = 0usize;
    let mut i = 0;
    let newline = |out: &mut String, depth: usize| {
        out.push('\n');
        for _ in 0..depth {
            out.push_str("  ");
        }
    };
    while i < bytes.len() && i < max {
        match bytes[i] {
            b'"' => {
                // A string, verbatim up to its closing quote (a backslash takes the next
                // byte with it), or up to `max`.
                let start = i;
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                let mut end = (i + 1).min(bytes.len());
                if end > max {
                    end = max;
                    while !text.is_char_boundary(end) {
                        end -= 1;
                    }
                }
                out.push_str(&text[start..end]);
                i = end;
            }
            open @ (b'{' | b'[') => {
                let close = if open == b'{' { b'}' } else { b']' };
                let mut j = i + 1;
                while j < bytes.len() && bytes[j].is_ascii_whitespace() {
                    j += 1;
                }
                if j < bytes.len() && bytes[j] == close {
                    out.push(char::from(open));
                    out.push(char::from(close));
                    i = j + 1;
                } else {
                    out.push(char::from(open));
                    depth += 1;
                    newline(&mut out, depth);
                    i += 1;
                }
            }
            c @ (b'}' | b']') => {
                depth = depth.saturating_sub(1);
                newline(&mut out, depth);
                out.push(char::from(c));
                i += 1;
            }
            b',' => {
                out.push(',');
                newline(&mut out, depth);
                i += 1;
            }
            b':' => {
                out.push_str(": ");
                i += 1;
            }
            c if c.is_ascii_whitespace() => i += 1,
            _ => {
                // A number or a literal (ASCII), verbatim.
                let start = i;
                while i < bytes.len()
                    && i < max
                    && !matches!(bytes[i], b',' | b'}' | b']' | b':' | b'"')
                    && !bytes[i].is_ascii_whitespace()
                {
                    i += 1;
                }
                out.push_str(&text[start..i]);
            }
        }
    }
    (out, i.min(bytes.len()))
}

/// What a page shows of a payload: text (re-indented JSON, or a hex dump of bytes that are
/// not JSON) of at most a cap of the payload's bytes, and how much that is of the whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Shown {
    pub text: String,
    pub json: bool,
    /// Bytes of the payload shown (from its start).
    pub shown: usize,
    /// Bytes of the payload in all.
    pub total: usize,
}

impl Shown {
    pub(crate) fn cut(&self) -> bool {
        self.shown < self.total
    }
}

/// The first `cap` bytes of the payload `bytes` as shown: JSON re-indented (cut at a
/// character boundary), else a hex dump of them. The cap counts the payload's bytes, not
/// the rendered text's (a hex dump is about 5 times longer).
pub(crate) fn shown(bytes: &[u8], cap: usize) -> Shown {
    if let Some(text) = json_text(bytes) {
        let (text, shown) = indent(text, cap);
        return Shown {
            text,
            json: true,
            shown,
            total: bytes.len(),
        };
    }
    let fit = cap.min(bytes.len());
    Shown {
        text: hex_dump(&bytes[..fit]),
        json: false,
        shown: fit,
        total: bytes.len(),
    }
}

/// `text` cut to at most `cap` bytes at a character boundary, with "…" when cut.
pub(crate) fn clip(text: &str, cap: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= cap {
        return text.into();
    }
    let mut end = cap;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} of {} bytes shown)", &text[..end], end, text.len()).into()
}

/// Bytes as a hex dump: 16 a line, offset, hex, printable ASCII.
pub(crate) fn hex_dump(bytes: &[u8]) -> String {
    let mut out = String::new();
    for (i, chunk) in bytes.chunks(16).enumerate() {
        let _ = write!(out, "{:08x}  ", i * 16);
        for b in chunk {
            let _ = write!(out, "{b:02x} ");
        }
        for _ in chunk.len()..16 {
            out.push_str("   ");
        }
        out.push(' ');
        out.extend(chunk.iter().map(|&b| {
            if b.is_ascii_graphic() || b == b' ' {
                char::from(b)
            } else {
                '.'
            }
        }));
        out.push('\n');
    }
    out
}

/// A sparkline of `values` (oldest first) as inline SVG, `width`×`height` pixels, with a
/// text alternative; `None` values are gaps. Fewer than two values draw a flat line.
pub(crate) fn sparkline(values: &[Option<f64>], label: &str) -> Markup {
    const W: f64 = 120.0;
    const H: f64 = 24.0;
    let known: Vec<f64> = values.iter().flatten().copied().collect();
    let max = known.iter().copied().fold(0.0_f64, f64::max);
    let min = known.iter().copied().fold(max, f64::min);
    let range = if max > min { max - min } else { 1.0 };
    let step = if values.len() > 1 {
        W / (values.len() - 1) as f64
    } else {
        W
    };
    let mut points = String::new();
    for (i, v) in values.iter().enumerate() {
        if let Some(v) = v {
            let x = i as f64 * step;
            // A flat series is drawn across the middle, not along the bottom (which reads
            // as zero).
            let y = if max > min {
                H - 2.0 - (v - min) / range * (H - 4.0)
            } else {
                H / 2.0
            };
            let _ = write!(points, "{x:.1},{y:.1} ");
        }
    }
    if known.len() < 2 {
        points = format!("0,{m:.1} {W:.1},{m:.1}", m = H / 2.0);
    }
    let alt = match known.last() {
        Some(last) => format!("{label}: {} samples, last {last}, max {max}", known.len()),
        None => format!("{label}: no samples yet"),
    };
    html! {
        svg class="spark" width="120" height="24" viewBox="0 0 120 24" role="img" aria-label=(alt) {
            title { (alt) }
            polyline fill="none" stroke="currentColor" stroke-width="1.5" points=(points.trim_end()) {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000 + secs, 0).unwrap()
    }

    #[test]
    fn relative_ages() {
        assert_eq!(relative(t(3), t(0)), "in 3 s");
        assert_eq!(relative(t(0), t(720)), "12 min ago");
        assert_eq!(relative(t(0), t(0)), "now");
        assert_eq!(relative(t(7200), t(0)), "in 2 h");
        assert_eq!(relative(t(0), t(3 * 86_400)), "3 d ago");
        // Two units, not rounded down to one; years for very long.
        assert_eq!(relative(t(7140), t(0)), "in 1 h 59 min");
        assert_eq!(relative(t(0), t(2 * 86_400 + 3 * 3600 + 59)), "2 d 3 h ago");
        assert_eq!(relative(t(245), t(0)), "in 4 min 5 s");
        assert_eq!(
            relative(t(300 * 31_556_952 + 86_400 * 3), t(0)),
            "in 300 y 3 d"
        );
        assert_eq!(span(0), "0 s");
        assert_eq!(span(59), "59 s");
        assert_eq!(utc(t(0)), "2027-01-15 08:00:00 UTC");
    }

    #[test]
    fn payloads_and_counts() {
        assert_eq!(json(br#"{"a":1}"#).as_deref(), Some("{\n  \"a\": 1\n}"));
        assert_eq!(json(b"\xff\x00"), None);
        assert_eq!(
            hex_dump(b"ab\x00"),
            "00000000  61 62 00                                         ab.\n"
        );
        assert_eq!(count(Count::Exact(3)), "3");
        assert_eq!(count(Count::Unavailable), "–");
    }

    #[test]
    fn json_is_indented_from_its_stored_text() {
        let i = |t: &str| {
            assert!(json_text(t.as_bytes()).is_some(), "not JSON: {t}");
            indent(t, usize::MAX).0
        };
        // Big numbers, their spelling and key order as stored; duplicate keys kept.
        assert_eq!(
            i(r#"{"n":12345678901234567890123,"f":1.0000000000000000001,"e":1E+2}"#),
            "{\n  \"n\": 12345678901234567890123,\n  \"f\": 1.0000000000000000001,\n  \"e\": 1E+2\n}"
        );
        assert_eq!(
            i(r#"{"b":1,"a":2,"a":3}"#),
            "{\n  \"b\": 1,\n  \"a\": 2,\n  \"a\": 3\n}"
        );
        // Strings verbatim: braces, brackets, commas, colons, escaped quotes, backslashes,
        // unicode escapes and spaces inside them are not tokens.
        let s = r#""a{b}[c],d:e \" \\ \u00e9 \n  x""#;
        assert_eq!(i(s), s);
        assert_eq!(
            i(&format!(r#"{{ {s} : [ {s} , "\\" ] }}"#)),
            format!("{{\n  {s}: [\n    {s},\n    \"\\\\\"\n  ]\n}}")
        );
        // Nested, empty objects and arrays, literals, whitespace between tokens.
        assert_eq!(
            i(" {\"a\" : { } ,\"b\":[ ],\"c\":[{\"d\":[true,false,null,-0.5e-3]}]}\n"),
            "{\n  \"a\": {},\n  \"b\": [],\n  \"c\": [\n    {\n      \"d\": [\n        true,\n        false,\n        null,\n        -0.5e-3\n      ]\n    }\n  ]\n}"
        );
        assert_eq!(i("[]"), "[]");
        assert_eq!(i("12345678901234567890123"), "12345678901234567890123");
        assert_eq!(i(r#""é""#), r#""é""#);
        assert_eq!(json_text(br#"{"a":1"#), None);
        assert_eq!(json_text(b"{} x"), None);
        // Cut after `max` bytes of the stored text, at a character boundary.
        let (t, n) = indent(r#"["éé",1]"#, 4);
        assert_eq!((t.as_str(), n), ("[\n  \"é", 4));
        let (t, n) = indent(r#"[12345,1]"#, 3);
        assert_eq!((t.as_str(), n), ("[\n  12", 3));
    }

    #[test]
    fn a_large_payload_is_cut_to_the_cap() {
        let big = format!("{{\"a\":\"{}\"}}", "é".repeat(100_000));
        let s = shown(big.as_bytes(), 1000);
        assert!(s.json && s.cut() && s.shown == 1000, "{s:?}");
        assert_eq!(s.total, big.len());
        let bytes = vec![0xffu8; 100_000];
        let s = shown(&bytes, 160);
        assert!(!s.json && s.shown == 160 && s.total == 100_000, "{s:?}");
        assert_eq!(s.text.lines().count(), 10);
        let small = shown(br#"{"a":1}"#, 1000);
        assert!(!small.cut());
        assert_eq!(clip("abc", 3), "abc");
        assert_eq!(clip("aéb", 2), "a… (1 of 4 bytes shown)");
    }

    #[test]
    fn sparkline_scales_into_its_box_and_escapes_its_label() {
        let svg = sparkline(&[Some(0.0), None, Some(10.0)], "<q>").into_string();
        assert!(svg.contains(r#"points="0.0,22.0 120.0,2.0""#), "{svg}");
        assert!(svg.contains("&lt;q&gt;"), "{svg}");
        assert!(!svg.contains("<q>"), "{svg}");
        let level = sparkline(&[Some(5.0), Some(5.0)], "q").into_string();
        assert!(level.contains(r#"points="0.0,12.0 120.0,12.0""#), "{level}");
        let flat = sparkline(&[], "q").into_string();
        assert!(flat.contains("no samples yet"), "{flat}");
    }
}
