//! Retry strategies: how long a failed run waits before the next attempt, and
//! when to give up.

use std::time::Duration;

use crate::error::{Error, Result};

/// The longest single retry delay a strategy may produce: 30 days.
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(30 * 24 * 3600);

#[derive(Debug, Clone, Copy, PartialEq)]
enum Backoff {
    None,
    Constant(Duration),
    Linear { initial: Duration, step: Duration },
    Exponential { initial: Duration, multiplier: f64 },
}

/// How a handler error is retried.
///
/// The delay before attempt `n + 1` after the `n`-th failed run (n = 1, 2, …):
///
/// | strategy | delay |
/// |---|---|
/// | [`none`](RetryStrategy::none) | no retry: the first failure is terminal (`retry_exhausted`) |
/// | [`constant(d)`](RetryStrategy::constant) | `d` |
/// | [`linear(initial, step)`](RetryStrategy::linear) | `initial + (n − 1) × step` |
/// | [`exponential(initial, multiplier)`](RetryStrategy::exponential) | `initial × multiplier^(n − 1)` |
///
/// then capped by [`cap`](RetryStrategy::cap) and spread by
/// [`jitter`](RetryStrategy::jitter) (a fraction `j`: the delay is drawn uniformly from
/// `[d × (1 − j), d × (1 + j)]`, and capped again). The run is terminal with reason
/// `retry_exhausted` once `n` reaches [`max_attempts`](RetryStrategy::max_attempts) (the
/// number of runs in total), or when the time since the first failure plus the next delay
/// would pass [`max_total_delay`](RetryStrategy::max_total_delay).
///
/// The delay is applied by the database clock (`now() + delay`).
///
/// The default: exponential from 1 s, ×2, capped at 300 s, 20 % jitter,
/// 10 attempts.
#[derive(Debug, Clone, Copy, PartialEq)]
#[must_use = "a RetryStrategy applies only once given to `HandlerOptions::retry`"]
pub struct RetryStrategy {
    backoff: Backoff,
    cap: Duration,
    jitter: f64,
    max_attempts: Option<u32>,
    max_total_delay: Option<Duration>,
}

impl Default for RetryStrategy {
    fn default() -> Self {
        RetryStrategy::exponential(Duration::from_secs(1), 2.0)
            .cap(Duration::from_secs(300))
            .jitter(0.2)
            .max_attempts(10)
    }
}

impl RetryStrategy {
    fn with(backoff: Backoff) -> Self {
        RetryStrategy {
            backoff,
            cap: MAX_RETRY_DELAY,
            jitter: 0.0,
            max_attempts: None,
            max_total_delay: None,
        }
    }

    /// Never retry: a failed run is terminal at once (reason `retry_exhausted`), whether the
    /// handler returned an error or asked for `Outcome::RetryAfter`, and a run stopped at
    /// shutdown ends with reason `aborted`.
    pub fn none() -> Self {
        Self::with(Backoff::None)
    }

    /// The same `delay` every time.
    pub fn constant(delay: Duration) -> Self {
        Self::with(Backoff::Constant(delay))
    }

    /// `initial`, then `step` longer each time.
    pub fn linear(initial: Duration, step: Duration) -> Self {
        Self::with(Backoff::Linear { initial, step })
    }

    /// `initial`, then `multiplier` times longer each time (`multiplier` ≥ 1).
    pub fn exponential(initial: Duration, multiplier: f64) -> Self {
        Self::with(Backoff::Exponential {
            initial,
            multiplier,
        })
    }

    /// The longest delay (default and maximum [`MAX_RETRY_DELAY`]).
    pub fn cap(mut self, cap: Duration) -> Self {
        self.cap = cap;
        self
    }

    /// Random spread as a fraction of the delay, in `0.0..=1.0` (default 0).
    pub fn jitter(mut self, fraction: f64) -> Self {
        self.jitter = fraction;
        self
    }

    /// Total runs before giving up (≥ 1; `1` means no retry).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = Some(attempts);
        self
    }

    /// Give up once the time since the first failure plus the next delay would pass this.
    pub fn max_total_delay(mut self, total: Duration) -> Self {
        self.max_total_delay = Some(total);
        self
    }

    /// Checks the parameters; called when a worker is built.
    pub(crate) fn validate(&self, knob: &'static str) -> Result<()> {
        if let Backoff::Exponential { multiplier, .. } = self.backoff {
            if !(multiplier.is_finite() && multiplier >= 1.0) {
                return Err(Error::config(
                    knob,
                    format!("the multiplier must be a finite number ≥ 1, got {multiplier}"),
                ));
            }
        }
        if !(self.jitter.is_finite() && (0.0..=1.0).contains(&self.jitter)) {
            return Err(Error::config(
                knob,
                format!("jitter must be within 0.0..=1.0, got {}", self.jitter),
            ));
        }
        if self.cap > MAX_RETRY_DELAY {
            return Err(Error::config(knob, "the cap may be at most 30 days"));
        }
        if self.max_attempts == Some(0) {
            return Err(Error::config(knob, "max_attempts must be at least 1"));
        }
        Ok(())
    }

    /// Whether the strategy allows another run after the `failures`-th failed one: never for
    /// [`RetryStrategy::none`], else as `max_attempts` says. An explicit
    /// `Outcome::RetryAfter` and a run stopped at shutdown obey it too.
    pub(crate) fn allows_another(&self, failures: u32) -> bool {
        !matches!(self.backoff, Backoff::None) && self.max_attempts.is_none_or(|max| failures < max)
    }

    /// The delay after the `failures`-th failed run (1-based), or `None` to give up.
    /// `elapsed` is the time since the first failure (zero for the first one). `unit` is a
    /// uniform random number in `[0, 1)` for the jitter.
    pub(crate) fn next_delay(
        &self,
        failures: u32,
        elapsed: Duration,
        unit: f64,
    ) -> Option<Duration> {
        if !self.allows_another(failures) {
            return None;
        }
        let n = failures.saturating_sub(1);
        let base = match self.backoff {
            Backoff::None => return None,
            Backoff::Constant(d) => d,
            Backoff::Linear { initial, step } => initial.saturating_add(step.saturating_mul(n)),
            Backoff::Exponential {
                initial,
                multiplier,
            } => {
                let secs = initial.as_secs_f64() * multiplier.powi(n.min(1024) as i32);
                Duration::try_from_secs_f64(secs).unwrap_or(MAX_RETRY_DELAY)
            }
        };
        let mut delay = base.min(self.cap);
        if self.jitter > 0.0 {
            let factor = 1.0 - self.jitter + 2.0 * self.jitter * unit;
            delay = Duration::try_from_secs_f64(delay.as_secs_f64() * factor)
                .unwrap_or(delay)
                .min(self.cap);
        }
        if self
            .max_total_delay
            .is_some_and(|max| elapsed.saturating_add(delay) > max)
        {
            return None;
        }
        Some(delay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn none_allows_no_other_run_whatever_max_attempts_says() {
        assert!(!RetryStrategy::none().allows_another(1));
        assert!(!RetryStrategy::none().max_attempts(5).allows_another(1));
        assert_eq!(
            RetryStrategy::none().next_delay(1, Duration::ZERO, 0.5),
            None
        );
        assert!(RetryStrategy::constant(Duration::ZERO).allows_another(1000));
        assert!(!RetryStrategy::constant(Duration::ZERO)
            .max_attempts(2)
            .allows_another(2));
    }

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn default_is_exponential_capped_with_ten_attempts() {
        let r = RetryStrategy::default();
        let d: Vec<_> = (1..=9)
            .map(|n| r.next_delay(n, Duration::ZERO, 0.5).unwrap().as_secs())
            .collect();
        assert_eq!(d, [1, 2, 4, 8, 16, 32, 64, 128, 256]);
        assert_eq!(
            r.next_delay(10, Duration::ZERO, 0.5),
            None,
            "10 attempts in total"
        );
        // 20 % jitter: 1 s spreads over [0.8 s, 1.2 s].
        assert_eq!(
            r.next_delay(1, Duration::ZERO, 0.0),
            Some(Duration::from_millis(800))
        );
        assert_eq!(
            r.next_delay(1, Duration::ZERO, 1.0),
            Some(Duration::from_millis(1200))
        );
        let capped = RetryStrategy::default().max_attempts(100);
        assert_eq!(
            capped.next_delay(20, Duration::ZERO, 1.0),
            Some(300 * S),
            "jitter never passes the cap"
        );
    }

    #[test]
    fn constant_linear_none() {
        assert_eq!(
            RetryStrategy::constant(5 * S).next_delay(7, Duration::ZERO, 0.3),
            Some(5 * S)
        );
        let l = RetryStrategy::linear(S, 2 * S);
        assert_eq!(l.next_delay(1, Duration::ZERO, 0.0), Some(S));
        assert_eq!(l.next_delay(3, Duration::ZERO, 0.0), Some(5 * S));
        assert_eq!(
            RetryStrategy::none().next_delay(1, Duration::ZERO, 0.0),
            None
        );
        assert_eq!(
            RetryStrategy::constant(S)
                .max_attempts(1)
                .next_delay(1, Duration::ZERO, 0.0),
            None
        );
    }

    #[test]
    fn max_total_delay_counts_elapsed_plus_next() {
        let r = RetryStrategy::constant(10 * S).max_total_delay(60 * S);
        assert_eq!(r.next_delay(3, 50 * S, 0.0), Some(10 * S));
        assert_eq!(r.next_delay(4, 51 * S, 0.0), None);
    }

    #[test]
    fn huge_exponents_saturate() {
        let r = RetryStrategy::exponential(S, 10.0);
        assert_eq!(
            r.next_delay(u32::MAX - 1, Duration::ZERO, 0.0),
            Some(MAX_RETRY_DELAY)
        );
    }

    #[test]
    fn validation_names_the_knob() {
        let e = RetryStrategy::exponential(S, 0.5)
            .validate("retry")
            .unwrap_err();
        assert!(e.to_string().contains("`retry`"), "{e}");
        assert!(RetryStrategy::default()
            .jitter(1.5)
            .validate("retry")
            .is_err());
        assert!(RetryStrategy::default()
            .jitter(f64::NAN)
            .validate("retry")
            .is_err());
        assert!(RetryStrategy::default()
            .max_attempts(0)
            .validate("retry")
            .is_err());
        assert!(RetryStrategy::default().validate("retry").is_ok());
    }
}
