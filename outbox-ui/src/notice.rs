//! The notice an action's redirect carries to the page it returns to (`?ok=…` or
//! `?error=…`), signed so that a link cannot forge one: `sig=<unix seconds>.<hex HMAC>`,
//! an HMAC-SHA256 under a key made when the dashboard is built, over the kind, the instant
//! and the text. A notice without a valid signature, or older than [`NOTICE_TTL_SECS`], is
//! not shown (a link can still carry text, but the page never presents it as the
//! dashboard's word).

use std::fmt::Write as _;

use hmac::{Hmac, KeyInit, Mac};
use serde::Deserialize;
use sha2::Sha256;

/// How long a signed notice is shown after its action (seconds): long enough for the
/// redirect and a reload, short enough that an old link shows nothing.
pub(crate) const NOTICE_TTL_SECS: i64 = 600;

/// The notice fields of a page's query, as sent (unverified until [`Notice::shown`]), or a
/// notice the page made itself.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Notice {
    pub ok: Option<String>,
    pub error: Option<String>,
    sig: Option<String>,
    /// Set only by [`Notice::local`] (never from a query): the page's own text.
    #[serde(skip)]
    local: bool,
}

/// Which notice: a success or a refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Ok,
    Error,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Ok => "ok",
            Kind::Error => "error",
        }
    }
}

/// The per-dashboard key of the notices' HMAC.
#[derive(Debug)]
pub(crate) struct NoticeKey([u8; 32]);

impl NoticeKey {
    /// 244 random bits (two v4 UUIDs).
    pub(crate) fn random() -> Self {
        let mut k = [0u8; 32];
        k[..16].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
        k[16..].copy_from_slice(uuid::Uuid::new_v4().as_bytes());
        NoticeKey(k)
    }

    fn mac(&self, kind: Kind, at: i64, text: &str) -> Hmac<Sha256> {
        // The key is 32 bytes: HMAC takes a key of any length.
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC accepts every key length"));
        mac.update(kind.as_str().as_bytes());
        mac.update(b"\n");
        mac.update(at.to_string().as_bytes());
        mac.update(b"\n");
        mac.update(text.as_bytes());
        mac
    }

    /// The `sig` value of a notice made at `at` (unix seconds).
    pub(crate) fn sign(&self, kind: Kind, at: i64, text: &str) -> String {
        let tag = self.mac(kind, at, text).finalize().into_bytes();
        let mut out = format!("{at}.");
        for b in tag {
            let _ = write!(out, "{b:02x}");
        }
        out
    }

    /// Whether `sig` signs this notice and is at most [`NOTICE_TTL_SECS`] old at `now`.
    fn verify(&self, kind: Kind, text: &str, sig: &str, now: i64) -> bool {
        let Some((at, hex)) = sig.split_once('.') else {
            return false;
        };
        let Ok(at) = at.parse::<i64>() else {
            return false;
        };
        if now.saturating_sub(at) > NOTICE_TTL_SECS || at.saturating_sub(now) > 60 {
            return false;
        }
        let Some(tag) = unhex(hex) else {
            return false;
        };
        self.mac(kind, at, text).verify_slice(&tag).is_ok()
    }
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.is_ascii() {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

impl Notice {
    /// A notice the page itself makes (a failed search, a row that is gone): always shown.
    pub(crate) fn local(kind: Kind, text: String) -> Self {
        let (ok, error) = match kind {
            Kind::Ok => (Some(text), None),
            Kind::Error => (None, Some(text)),
        };
        Notice {
            ok,
            error,
            sig: None,
            local: true,
        }
    }

    /// The notice to show, if any: the page's own, or one whose signature `key` made less
    /// than [`NOTICE_TTL_SECS`] before `now` (unix seconds).
    pub(crate) fn shown(&self, key: &NoticeKey, now: i64) -> Option<(Kind, &str)> {
        let (kind, text) = match (&self.ok, &self.error) {
            (_, Some(e)) => (Kind::Error, e.as_str()),
            (Some(o), None) => (Kind::Ok, o.as_str()),
            (None, None) => return None,
        };
        if self.local {
            return Some((kind, text));
        }
        let sig = self.sig.as_deref()?;
        key.verify(kind, text, sig, now).then_some((kind, text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(ok: Option<&str>, error: Option<&str>, sig: Option<String>) -> Notice {
        Notice {
            ok: ok.map(str::to_owned),
            error: error.map(str::to_owned),
            sig,
            local: false,
        }
    }

    #[test]
    fn only_a_signed_fresh_notice_of_this_dashboard_is_shown() {
        let key = NoticeKey::random();
        let now = 1_800_000_000;
        let sig = key.sign(Kind::Ok, now, "mail: paused");
        let good = sent(Some("mail: paused"), None, Some(sig.clone()));
        assert_eq!(good.shown(&key, now + 5), Some((Kind::Ok, "mail: paused")));
        // Unsigned, other text, other kind, other key, too old, from the future.
        assert_eq!(
            sent(Some("Queue purged"), None, None).shown(&key, now),
            None
        );
        let forged = sent(Some("Queue purged, now run X"), None, Some(sig.clone()));
        assert_eq!(forged.shown(&key, now), None);
        let kind = sent(None, Some("mail: paused"), Some(sig.clone()));
        assert_eq!(kind.shown(&key, now), None);
        assert_eq!(good.shown(&NoticeKey::random(), now), None);
        assert_eq!(good.shown(&key, now + NOTICE_TTL_SECS + 1), None);
        assert_eq!(good.shown(&key, now - 120), None);
        for bad in ["", ".", "x.00", "1800000000.zz", "1800000000.00"] {
            let n = sent(Some("mail: paused"), None, Some(bad.to_owned()));
            assert_eq!(n.shown(&key, now), None, "{bad:?}");
        }
        let local = Notice::local(Kind::Error, "no such row".to_owned());
        assert_eq!(local.shown(&key, now), Some((Kind::Error, "no such row")));
    }
}
