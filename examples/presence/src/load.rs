//! The load driver: thousands of simulated users talking to the service over HTTP, and an
//! observer that checks every state it reads against what the clients did.
//!
//! # Users
//! Each user is one task with one request in flight at most. Its class decides its pings:
//!
//! | class | behaviour | at the end it must be |
//! |---|---|---|
//! | steady | pings every `U(0.1, 0.6) × timeout` until the run ends | online |
//! | edge | pings `timeout + U(0, handler delay + 20 ms)` after its previous ping, so the timer fires and the next ping lands **while the expiry handler runs** (a rearm); stops at a random time in the second half of the run | offline |
//! | silent | pings like a steady user, then stops for good at a random time | offline |
//! | logout | pings like a steady user, then logs out (`DELETE /users/{id}/session`); half of them log out `timeout + U(0, (handler delay + 20 ms) / 2)` after their last ping, so the cancel lands while the expiry handler runs; with `logout_after_rearm`, half of those ping just before (a rearm, which the cancel drops) | offline, reason `logout` |
//!
//! Silent and edge users stop at least `timeout + allowed lateness + 1 s` before the end.
//!
//! # Wrong transitions
//! The observer reads random users (`GET /users/{id}`) during the run and every user at the
//! end. A read sent at `g0` and answered at `g1` shows the state at some instant in
//! `[g0, g1]`. With `s` the send time of the user's last ping **acknowledged before `g0`**
//! and `a` its acknowledgement time, a read is a wrong transition when it shows:
//!
//! - **offline although pinging**: offline, the user has not started logging out, and
//!   `g1 + margin < s + timeout`. The server stores `last_seen` after the ping was sent, so
//!   the user may go offline no earlier than `s + timeout`; anything earlier is wrong;
//! - **online after silence**: online, no ping was in flight or sent during the read, and
//!   `g0 > a + timeout + allowed lateness`. `last_seen` is no later than `a`, so by then the
//!   timer has fired and its handler has set the user offline, unless it fired more than the
//!   allowed lateness late (which counts as wrong too);
//! - **online after logout**: online although the logout was acknowledged before `g0`;
//! - **missing**: `404` for a user with an acknowledged ping.
//!
//! The correct number is zero. `margin` only absorbs clock slew (default 50 ms).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::server::{Lateness, LogoutReply, PingReply, Stats, UserState};

/// Settings of [`run`].
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// The service, `http://host:port`.
    pub url: String,
    /// Simulated users.
    pub users: usize,
    /// How long users ping; the final check follows.
    pub duration: Duration,
    /// User ids are `first_user_id..first_user_id + users`.
    pub first_user_id: i64,
    /// Share of edge users (0..=1).
    pub edge: f64,
    /// Share of silent users.
    pub silent: f64,
    /// Share of logout users.
    pub logout: f64,
    /// Random reads per second during the run.
    pub observe_per_sec: u32,
    /// How late past `last ping + timeout` a user may still be seen online.
    pub allowed_lateness: Duration,
    /// Clock slew allowance of the "offline although pinging" rule.
    pub margin: Duration,
    /// Seed of every random choice (the timing of the server is not seeded).
    pub seed: u64,
    /// Print a summary line every second.
    pub live: bool,
    /// A quarter of the logout users ping while their expiry handler runs and log out
    /// right after, so the logout's cancel drops the queued rearm while the run's
    /// completion is on its way (on by default; the run must still end with its row
    /// deleted, which the final timer-row audit checks).
    pub logout_after_rearm: bool,
}

impl LoadConfig {
    /// Checks the settings that do not depend on the server.
    ///
    /// # Errors
    /// [`LoadError::Config`] naming the setting.
    pub fn validate(&self) -> Result<(), LoadError> {
        if self.users == 0 {
            return Err(LoadError::Config("--users must be at least 1".into()));
        }
        if self.duration.is_zero() {
            return Err(LoadError::Config("--seconds must be more than 0".into()));
        }
        let shares = [self.edge, self.silent, self.logout];
        if shares.iter().any(|s| !(0.0..=1.0).contains(s)) || shares.iter().sum::<f64>() > 1.0 {
            return Err(LoadError::Config(
                "the shares of edge, silent and logout users must be within 0..=1 and sum to at most 1"
                    .into(),
            ));
        }
        Ok(())
    }

    /// 2000 users for 30 s, 15 % edge, 12.5 % silent, 12.5 % logout, 200 reads/s, 1 s
    /// allowed lateness, a random seed and random user ids.
    pub fn new(url: impl Into<String>) -> Self {
        let mut rng = rand::rng();
        LoadConfig {
            url: url.into(),
            users: 2000,
            duration: Duration::from_secs(30),
            // Random, so runs against one long-lived server do not share users.
            first_user_id: rng.random_range(1..1_000_000_000i64) * 10_000,
            edge: 0.15,
            silent: 0.125,
            logout: 0.125,
            observe_per_sec: 200,
            allowed_lateness: Duration::from_secs(1),
            margin: Duration::from_millis(50),
            seed: rng.random(),
            live: true,
            logout_after_rearm: true,
        }
    }
}

/// Why [`run`] could not run.
#[derive(Debug)]
pub enum LoadError {
    /// A setting is unusable (the message says which).
    Config(String),
    /// The service did not answer `GET /stats`.
    Unreachable(String),
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadError::Config(m) => write!(f, "{m}"),
            LoadError::Unreachable(m) => write!(f, "{m}"),
        }
    }
}

impl std::error::Error for LoadError {}

/// A user's class (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// Pings until the end; must be online.
    Steady,
    /// Pings timed to land while the expiry handler runs, then silence; must be offline.
    Edge,
    /// Pings, then silence; must be offline.
    Silent,
    /// Pings, then logs out; must be offline.
    Logout,
}

/// What kind of wrong transition (see the [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrongKind {
    /// Offline within the timeout of an acknowledged ping.
    OfflineWhilePinging,
    /// Online longer than timeout + allowed lateness after the last ping.
    OnlineAfterSilence,
    /// Online after an acknowledged logout.
    OnlineAfterLogout,
    /// Unknown although a ping was acknowledged.
    Missing,
}

/// One wrong transition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wrong {
    /// The user.
    pub user_id: i64,
    /// What was wrong.
    pub kind: WrongKind,
    /// When it was read, since the start of the run.
    pub at: Duration,
    /// The timings that make it wrong.
    pub detail: String,
}

/// What a run saw.
#[derive(Debug, Clone)]
pub struct Report {
    /// The settings.
    pub config: LoadConfig,
    /// The server's timeout.
    pub timeout: Duration,
    /// The server's handler delay.
    pub handler_delay: Duration,
    /// From the first ping to the end of the final check.
    pub elapsed: Duration,
    /// User ids per class.
    pub steady: Vec<i64>,
    /// See [`Class::Edge`].
    pub edge: Vec<i64>,
    /// See [`Class::Silent`].
    pub silent: Vec<i64>,
    /// See [`Class::Logout`].
    pub logout: Vec<i64>,
    /// Pings acknowledged.
    pub pings: u64,
    /// Logouts acknowledged.
    pub logouts: u64,
    /// Reads judged, during the run and in the final check.
    pub observations: u64,
    /// Failed requests (each makes the run fail).
    pub errors: u64,
    /// The first few failed requests.
    pub error_samples: Vec<String>,
    /// Every wrong transition.
    pub wrong: Vec<Wrong>,
    /// Final states that do not match the user's class (for example a silent user still
    /// online at the end), whether or not they also count as wrong transitions.
    pub final_failures: Vec<String>,
    /// Users read online / offline in the final check.
    pub final_online: usize,
    /// See `final_online`.
    pub final_offline: usize,
    /// The server's stats at the end (`None` if it stopped answering).
    pub server: Option<Stats>,
}

impl Report {
    /// No wrong transition, no failed final check, no failed request.
    pub fn ok(&self) -> bool {
        self.wrong.is_empty() && self.final_failures.is_empty() && self.errors == 0
    }

    /// The final summary, several lines.
    pub fn summary(&self) -> String {
        let c = &self.config;
        let secs = self.elapsed.as_secs_f64().max(1e-9);
        let mut s = format!(
            "presence: {} users for {:.0} s (timeout {} ms, handler delay {} ms, seed {}, user ids {}..={})\n",
            c.users,
            c.duration.as_secs_f64(),
            self.timeout.as_millis(),
            self.handler_delay.as_millis(),
            c.seed,
            c.first_user_id,
            c.first_user_id + c.users as i64 - 1,
        );
        s += &format!(
            "  users            {} steady, {} edge, {} silent, {} logout; at the end {} online, {} offline\n",
            self.steady.len(),
            self.edge.len(),
            self.silent.len(),
            self.logout.len(),
            self.final_online,
            self.final_offline
        );
        s += &format!(
            "  pings            {} acknowledged ({:.0}/s)\n",
            self.pings,
            self.pings as f64 / secs
        );
        if let Some(st) = &self.server {
            s += &format!(
                "  ping → timer     inserted {}, extended {}, rearm queued {} (landed while the handler ran), unchanged {}\n",
                st.pings_inserted, st.pings_extended, st.pings_rearm_queued, st.pings_unchanged
            );
            s += &format!(
                "  logouts          {} (timer deleted {}, rearm dropped {}, handler running {}, no timer {})\n",
                st.logouts, st.cancel_deleted, st.cancel_rearm_dropped, st.cancel_running, st.cancel_not_found
            );
            s += &format!(
                "  timers fired     {} (went offline {}, kept online by a newer ping {} (re-armed by the handler {}), already offline {}, handler errors {})\n",
                st.fired, st.went_offline, st.kept_online, st.rearmed_by_handler, st.already_offline, st.handler_errors
            );
            s += &format!(
                "  rearms applied   {}   retried {}   terminal {}   lease lost {}\n",
                opt(st.rearms_applied),
                opt(st.retried),
                opt(st.terminal),
                opt(st.lease_lost)
            );
            s += &format!("  late firings     {}\n", lateness(st.lateness.as_ref()));
        }
        s += &format!(
            "  observations     {} reads judged, {} failed requests\n",
            self.observations, self.errors
        );
        for e in &self.error_samples {
            s += &format!("    error: {e}\n");
        }
        s += &format!("  wrong transitions {}\n", self.wrong.len());
        for w in self.wrong.iter().take(20) {
            s += &format!(
                "    user {} {:?} at {:.3} s: {}\n",
                w.user_id,
                w.kind,
                w.at.as_secs_f64(),
                w.detail
            );
        }
        if self.final_failures.is_empty() {
            s += "  final check      every steady user online, every silent/edge user offline, every logged-out user offline\n";
        } else {
            s += &format!("  final check      {} FAILED\n", self.final_failures.len());
            for f in self.final_failures.iter().take(20) {
                s += &format!("    {f}\n");
            }
        }
        s += if self.ok() {
            "  load result      OK\n"
        } else {
            "  load result      FAILED\n"
        };
        s
    }
}

fn opt(v: Option<u64>) -> String {
    v.map_or_else(|| "n/a".to_owned(), |v| v.to_string())
}

fn lateness(l: Option<&Lateness>) -> String {
    match l {
        Some(l) => format!(
            "p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms (firing time − deadline, {} firings)",
            l.p50_ms, l.p99_ms, l.max_ms, l.count
        ),
        None => "none yet".to_owned(),
    }
}

/// What the clients know about one user.
#[derive(Debug, Clone, Copy, Default)]
struct Track {
    /// Pings sent.
    sent: u64,
    /// A ping or logout is in flight.
    inflight: bool,
    /// Send time of the latest acknowledged ping.
    last_acked_send: Option<Instant>,
    /// Acknowledgement time of the latest ping.
    last_ack: Option<Instant>,
    logout_started: Option<Instant>,
    logout_acked: Option<Instant>,
    /// A request failed: whether it took effect is unknown, so reads are not judged.
    uncertain: bool,
}

#[derive(Debug, Clone, Copy)]
struct Plan {
    class: Class,
    first: Duration,
    /// Silent and edge: last ping before this. Logout: the logout time.
    until: Duration,
}

/// The most requests of the simulated users in flight at once. Load driver and service
/// share one process here, so every request in flight holds two sockets of its file
/// descriptors (a client's and the server's accepted one); ten thousand users pinging at
/// once would exhaust the process's limit (seen: `accept error: Too many open files`, then
/// a run that stops making progress). A user whose turn waits sends its ping late, as over
/// a slow network; the checks use the time the request actually went out.
const IN_FLIGHT: usize = 512;

struct Shared {
    config: LoadConfig,
    client: reqwest::Client,
    /// Bounds the users' requests in flight ([`IN_FLIGHT`]).
    in_flight: Semaphore,
    timeout: Duration,
    edge_window: Duration,
    start: Instant,
    tracks: Vec<Mutex<Track>>,
    pings: AtomicU64,
    logouts: AtomicU64,
    observations: AtomicU64,
    errors: AtomicU64,
    error_samples: Mutex<Vec<String>>,
    wrong: Mutex<Vec<Wrong>>,
}

impl Shared {
    fn id(&self, i: usize) -> i64 {
        self.config.first_user_id + i as i64
    }

    fn track(&self, i: usize) -> Track {
        *self.tracks[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    fn update(&self, i: usize, f: impl FnOnce(&mut Track)) {
        f(&mut self.tracks[i].lock().unwrap_or_else(|p| p.into_inner()));
    }

    fn error(&self, what: String) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        let mut s = self.error_samples.lock().unwrap_or_else(|p| p.into_inner());
        if s.len() < 10 {
            s.push(what);
        }
    }

    async fn ping(&self, i: usize) {
        let _turn = self.in_flight.acquire().await;
        let sent = Instant::now();
        self.update(i, |t| {
            t.sent += 1;
            t.inflight = true;
        });
        let url = format!("{}/users/{}/ping", self.config.url, self.id(i));
        let res = async {
            let r = self.client.post(&url).send().await?.error_for_status()?;
            r.json::<PingReply>().await
        }
        .await;
        let acked = Instant::now();
        match res {
            Ok(_) => {
                self.pings.fetch_add(1, Ordering::Relaxed);
                self.update(i, |t| {
                    t.inflight = false;
                    t.last_acked_send = Some(sent);
                    t.last_ack = Some(acked);
                });
            }
            Err(e) => {
                self.update(i, |t| {
                    t.inflight = false;
                    t.uncertain = true;
                });
                self.error(format!("POST {url}: {e}"));
            }
        }
    }

    async fn logout(&self, i: usize) {
        let _turn = self.in_flight.acquire().await;
        self.update(i, |t| {
            t.inflight = true;
            t.logout_started = Some(Instant::now());
        });
        let url = format!("{}/users/{}/session", self.config.url, self.id(i));
        let res = async {
            let r = self.client.delete(&url).send().await?.error_for_status()?;
            r.json::<LogoutReply>().await
        }
        .await;
        let acked = Instant::now();
        match res {
            Ok(_) => {
                self.logouts.fetch_add(1, Ordering::Relaxed);
                self.update(i, |t| {
                    t.inflight = false;
                    t.logout_acked = Some(acked);
                });
            }
            Err(e) => {
                self.update(i, |t| {
                    t.inflight = false;
                    t.uncertain = true;
                });
                self.error(format!("DELETE {url}: {e}"));
            }
        }
    }

    /// Reads one user and judges what it shows; `None` if the request failed.
    async fn observe(&self, i: usize) -> Option<Seen> {
        let before = self.track(i);
        let g0 = Instant::now();
        let url = format!("{}/users/{}", self.config.url, self.id(i));
        let res = async {
            let r = self.client.get(&url).send().await?;
            if r.status() == reqwest::StatusCode::NOT_FOUND {
                return Ok(Seen::Missing);
            }
            let u: UserState = r.error_for_status()?.json().await?;
            Ok::<_, reqwest::Error>(if u.online {
                Seen::Online
            } else {
                Seen::Offline(u.offline_reason)
            })
        }
        .await;
        let g1 = Instant::now();
        let after = self.track(i);
        let seen = match res {
            Ok(s) => s,
            Err(e) => {
                self.error(format!("GET {url}: {e}"));
                return None;
            }
        };
        self.observations.fetch_add(1, Ordering::Relaxed);
        let rules = Rules {
            timeout: self.timeout,
            allowed_lateness: self.config.allowed_lateness,
            margin: self.config.margin,
        };
        if let Some((kind, detail)) = rules.judge(&before, &after, g0, g1, &seen) {
            self.wrong
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Wrong {
                    user_id: self.id(i),
                    kind,
                    at: g0 - self.start,
                    detail,
                });
        }
        Some(seen)
    }
}

/// What a read showed.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Online,
    Offline(Option<String>),
    Missing,
}

/// The wrong-transition rules of the [module docs](self).
#[derive(Debug, Clone, Copy)]
struct Rules {
    timeout: Duration,
    allowed_lateness: Duration,
    margin: Duration,
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

impl Rules {
    /// `before`/`after`: the client's knowledge when the read was sent (`g0`) and answered
    /// (`g1`).
    fn judge(
        &self,
        before: &Track,
        after: &Track,
        g0: Instant,
        g1: Instant,
        seen: &Seen,
    ) -> Option<(WrongKind, String)> {
        if before.uncertain || after.uncertain {
            return None;
        }
        match seen {
            Seen::Missing => before.last_acked_send.map(|s| {
                (
                    WrongKind::Missing,
                    format!(
                        "ping sent {} ms before the read was acknowledged",
                        ms(g0 - s)
                    ),
                )
            }),
            Seen::Offline(_) => {
                if before.logout_started.is_some() {
                    return None;
                }
                let s = before.last_acked_send?;
                (g1 + self.margin < s + self.timeout).then(|| {
                    (
                        WrongKind::OfflineWhilePinging,
                        format!(
                            "offline {} ms after the last acknowledged ping was sent (timeout {} ms)",
                            ms(g1 - s),
                            ms(self.timeout)
                        ),
                    )
                })
            }
            Seen::Online => {
                if let Some(l) = before.logout_acked {
                    return Some((
                        WrongKind::OnlineAfterLogout,
                        format!("online {} ms after the logout was acknowledged", ms(g0 - l)),
                    ));
                }
                if before.inflight || after.sent != before.sent || before.logout_started.is_some() {
                    return None;
                }
                let a = before.last_ack?;
                (g0 > a + self.timeout + self.allowed_lateness).then(|| {
                    (
                        WrongKind::OnlineAfterSilence,
                        format!(
                            "online {} ms after the last ping was acknowledged (timeout {} ms + allowed lateness {} ms)",
                            ms(g0 - a),
                            ms(self.timeout),
                            ms(self.allowed_lateness)
                        ),
                    )
                })
            }
        }
    }
}

fn uniform(rng: &mut StdRng, lo: Duration, hi: Duration) -> Duration {
    if hi <= lo {
        return lo;
    }
    Duration::from_secs_f64(rng.random_range(lo.as_secs_f64()..hi.as_secs_f64()))
}

/// Sleeps until `at`; true if stopped meanwhile.
async fn sleep_until_or_stop(at: Instant, stop: &mut watch::Receiver<bool>) -> bool {
    if *stop.borrow() {
        return true;
    }
    let stopped = tokio::select! {
        () = tokio::time::sleep_until(at) => false,
        _ = stop.wait_for(|s| *s) => true,
    };
    stopped || *stop.borrow()
}

async fn user(sh: Arc<Shared>, i: usize, plan: Plan, seed: u64, mut stop: watch::Receiver<bool>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let t = sh.timeout;
    let until = sh.start + plan.until;
    let mut next = sh.start + plan.first;
    let mut last_sent = None;
    loop {
        if plan.class == Class::Logout && next >= until {
            // Half of the logout users log out just after their timer fired, while the
            // expiry handler runs, so the cancel finds the row leased (`Cancelled::Running`).
            // With `logout_after_rearm`, half of those first ping (which queues a rearm)
            // and log out right after it (`Cancelled::RearmDropped`).
            let at = match last_sent {
                Some(s) if i % 2 == 1 => {
                    s + t + uniform(&mut rng, Duration::ZERO, sh.edge_window / 2)
                }
                _ => until,
            };
            if !sleep_until_or_stop(at, &mut stop).await {
                if i % 4 == 3 && sh.config.logout_after_rearm {
                    sh.ping(i).await;
                }
                sh.logout(i).await;
            }
            return;
        }
        if matches!(plan.class, Class::Silent | Class::Edge) && next >= until {
            return;
        }
        if sleep_until_or_stop(next, &mut stop).await {
            return;
        }
        let sent = Instant::now();
        last_sent = Some(sent);
        sh.ping(i).await;
        next = match plan.class {
            // Lands just after the timer fired: during the handler's simulated work, its
            // transaction, or its completion.
            Class::Edge => sent + t + uniform(&mut rng, Duration::ZERO, sh.edge_window),
            _ => sent + uniform(&mut rng, t / 10, t * 6 / 10),
        };
    }
}

/// Reads random users at `observe_per_sec` until stopped.
async fn observer(sh: Arc<Shared>, seed: u64, mut stop: watch::Receiver<bool>) {
    if sh.config.observe_per_sec == 0 {
        let _ = stop.wait_for(|s| *s).await;
        return;
    }
    let mut rng = StdRng::seed_from_u64(seed);
    let period = Duration::from_secs_f64(1.0 / f64::from(sh.config.observe_per_sec));
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    // Bounded: a slow server gets fewer reads, not a pile of them.
    let permits = Arc::new(Semaphore::new(32));
    let mut reads = JoinSet::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => break,
        }
        while reads.try_join_next().is_some() {}
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            continue;
        };
        let i = rng.random_range(0..sh.tracks.len());
        let sh = sh.clone();
        reads.spawn(async move {
            sh.observe(i).await;
            drop(permit);
        });
    }
    while reads.join_next().await.is_some() {}
}

async fn fetch_stats(
    client: &reqwest::Client,
    url: &str,
    first: i64,
    count: usize,
) -> Result<Stats, reqwest::Error> {
    client
        .get(format!("{url}/stats?first={first}&count={count}"))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await
}

/// Runs the load against the service at `config.url` and checks every user at the end.
///
/// # Errors
/// [`LoadError::Unreachable`] if the service does not answer, [`LoadError::Config`] for
/// settings that cannot work with the server's timeout (the duration must leave time for
/// silent users to expire).
pub async fn run(config: LoadConfig) -> Result<Report, LoadError> {
    config.validate()?;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .pool_max_idle_per_host(1024)
        .build()
        .map_err(|e| LoadError::Config(format!("http client: {e}")))?;
    let url = config.url.trim_end_matches('/').to_owned();
    let initial = fetch_stats(&client, &url, config.first_user_id, config.users)
        .await
        .map_err(|e| {
            LoadError::Unreachable(format!(
                "the presence service at {url} does not answer GET /stats: {e}"
            ))
        })?;
    let timeout = Duration::from_millis(initial.timeout_ms);
    let handler_delay = Duration::from_millis(initial.handler_delay_ms);
    // Silent and edge users stop early enough to have expired, late included, with a
    // second to spare before the final check.
    let quiet = timeout + config.allowed_lateness + Duration::from_secs(1);
    let d = config.duration;
    if d < quiet * 2 {
        return Err(LoadError::Config(format!(
            "a run of {:.1} s is too short for the server's timeout of {} ms: use at least {:.1} s",
            d.as_secs_f64(),
            timeout.as_millis(),
            (quiet * 2).as_secs_f64()
        )));
    }

    let mut rng = StdRng::seed_from_u64(config.seed);
    let ramp = (timeout / 2).min(Duration::from_secs(2));
    let mut plans = Vec::with_capacity(config.users);
    for _ in 0..config.users {
        let x: f64 = rng.random();
        let class = if x < config.edge {
            Class::Edge
        } else if x < config.edge + config.silent {
            Class::Silent
        } else if x < config.edge + config.silent + config.logout {
            Class::Logout
        } else {
            Class::Steady
        };
        let until = match class {
            Class::Steady => d * 10,
            Class::Edge => uniform(&mut rng, d / 2, d - quiet),
            Class::Silent => uniform(&mut rng, d / 5, d - quiet),
            // Logged out (at the latest one timeout later) before the final check.
            Class::Logout => uniform(&mut rng, d / 5, d - quiet),
        };
        plans.push(Plan {
            class,
            first: uniform(&mut rng, Duration::ZERO, ramp),
            until,
        });
    }

    let start = Instant::now();
    let sh = Arc::new(Shared {
        config: LoadConfig {
            url: url.clone(),
            ..config
        },
        client: client.clone(),
        in_flight: Semaphore::new(IN_FLIGHT),
        timeout,
        edge_window: handler_delay + Duration::from_millis(20),
        start,
        tracks: (0..plans.len())
            .map(|_| Mutex::new(Track::default()))
            .collect(),
        pings: AtomicU64::new(0),
        logouts: AtomicU64::new(0),
        observations: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        error_samples: Mutex::new(Vec::new()),
        wrong: Mutex::new(Vec::new()),
    });
    let config = &sh.config;
    let (stop_users, users_stopped) = watch::channel(false);
    let mut users = JoinSet::new();
    // The users who log out: their tasks end once their logout was answered, which the
    // final check waits for (a logout queued behind other requests, IN_FLIGHT, may still
    // be on its way when the run's time is up).
    let mut leaving = JoinSet::new();
    for (i, plan) in plans.iter().enumerate() {
        let set = if plan.class == Class::Logout {
            &mut leaving
        } else {
            &mut users
        };
        set.spawn(user(
            sh.clone(),
            i,
            *plan,
            rng.random(),
            users_stopped.clone(),
        ));
    }
    let (stop_observer, observer_stopped) = watch::channel(false);
    let observer = tokio::spawn(observer(sh.clone(), rng.random(), observer_stopped));

    // The live summary, once a second.
    let mut second = 0u64;
    let mut last_pings = 0;
    while start.elapsed() < d {
        second += 1;
        let at = (start + Duration::from_secs(second)).min(start + d);
        tokio::time::sleep_until(at).await;
        if !config.live {
            continue;
        }
        let pings = sh.pings.load(Ordering::Relaxed);
        let rate = pings - last_pings;
        last_pings = pings;
        let wrong = sh.wrong.lock().unwrap_or_else(|p| p.into_inner()).len();
        let line = match fetch_stats(&client, &url, config.first_user_id, config.users).await {
            Ok(st) => format!(
                "online {:>5} offline {:>5} | pings/s {:>5} | fired {:>5} (offline {:>4}, kept online {:>4}) | rearms queued {:>4} applied {:>4} | late p50 {:>5.1} ms p99 {:>6.1} ms",
                st.online,
                st.offline,
                rate,
                st.fired,
                st.went_offline,
                st.kept_online,
                st.pings_rearm_queued,
                opt(st.rearms_applied),
                st.lateness.map_or(0.0, |l| l.p50_ms),
                st.lateness.map_or(0.0, |l| l.p99_ms),
            ),
            Err(e) => format!("stats unavailable: {e}"),
        };
        println!(
            "[{:>3} s] {line} | wrong {wrong} errors {}",
            second.min(d.as_secs().max(1)),
            sh.errors.load(Ordering::Relaxed)
        );
    }

    let _ = stop_observer.send(true);
    let _ = observer.await;
    // Every logout planned within the run has been answered before the final check reads
    // the users (bounded: a service that stops answering fails the check instead).
    let _ = tokio::time::timeout(timeout + Duration::from_secs(10), async {
        while leaving.join_next().await.is_some() {}
    })
    .await;

    // The final check: every user, while steady users keep pinging.
    let permits = Arc::new(Semaphore::new(32));
    let mut reads = JoinSet::new();
    for (i, plan) in plans.iter().enumerate() {
        let sh = sh.clone();
        let permits = permits.clone();
        let class = plan.class;
        reads.spawn(async move {
            let _permit = permits.acquire_owned().await;
            let seen = sh.observe(i).await;
            (i, class, seen)
        });
    }
    let mut final_failures = Vec::new();
    let (mut final_online, mut final_offline) = (0, 0);
    while let Some(r) = reads.join_next().await {
        let Ok((i, class, seen)) = r else { continue };
        let Some(seen) = seen else { continue };
        match seen {
            Seen::Online => final_online += 1,
            Seen::Offline(_) => final_offline += 1,
            Seen::Missing => {}
        }
        let ok = match (class, &seen) {
            (Class::Steady, Seen::Online) => true,
            (Class::Edge | Class::Silent, Seen::Offline(r)) => r.as_deref() == Some("expired"),
            (Class::Logout, Seen::Offline(r)) => r.as_deref() == Some("logout"),
            _ => false,
        };
        if !ok {
            final_failures.push(format!(
                "{class:?} user {} is {seen:?} at the end",
                sh.id(i)
            ));
        }
    }
    final_failures.sort();
    let _ = stop_users.send(true);
    while users.join_next().await.is_some() {}
    while leaving.join_next().await.is_some() {}
    let elapsed = start.elapsed();
    let server = fetch_stats(&client, &url, config.first_user_id, config.users)
        .await
        .ok();

    let ids = |c: Class| -> Vec<i64> {
        plans
            .iter()
            .enumerate()
            .filter(|(_, p)| p.class == c)
            .map(|(i, _)| sh.id(i))
            .collect()
    };
    let mut wrong = sh.wrong.lock().unwrap_or_else(|p| p.into_inner()).clone();
    wrong.sort_by_key(|w| w.at);
    let error_samples = sh
        .error_samples
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    Ok(Report {
        config: sh.config.clone(),
        timeout,
        handler_delay,
        elapsed,
        steady: ids(Class::Steady),
        edge: ids(Class::Edge),
        silent: ids(Class::Silent),
        logout: ids(Class::Logout),
        pings: sh.pings.load(Ordering::Relaxed),
        logouts: sh.logouts.load(Ordering::Relaxed),
        observations: sh.observations.load(Ordering::Relaxed),
        errors: sh.errors.load(Ordering::Relaxed),
        error_samples,
        wrong,
        final_failures,
        final_online,
        final_offline,
        server,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> Rules {
        Rules {
            timeout: Duration::from_secs(2),
            allowed_lateness: Duration::from_secs(1),
            margin: Duration::from_millis(50),
        }
    }

    fn acked(sent: Instant, ack: Instant) -> Track {
        Track {
            sent: 1,
            last_acked_send: Some(sent),
            last_ack: Some(ack),
            ..Track::default()
        }
    }

    #[test]
    fn offline_within_the_timeout_is_wrong() {
        let s = Instant::now();
        let t = acked(s, s + Duration::from_millis(5));
        let g0 = s + Duration::from_millis(1000);
        let off = Seen::Offline(Some("expired".into()));
        let (kind, _) = rules()
            .judge(&t, &t, g0, g0 + Duration::from_millis(2), &off)
            .unwrap();
        assert_eq!(kind, WrongKind::OfflineWhilePinging);
        // Past the timeout it is fine.
        let g0 = s + Duration::from_millis(2000);
        assert!(rules().judge(&t, &t, g0, g0, &off).is_none());
        // A logout in flight makes offline fine.
        let mut l = t;
        l.logout_started = Some(s + Duration::from_millis(10));
        assert!(rules()
            .judge(
                &l,
                &l,
                s + Duration::from_millis(500),
                s + Duration::from_millis(501),
                &off
            )
            .is_none());
    }

    #[test]
    fn online_long_after_silence_is_wrong_unless_a_ping_is_in_flight() {
        let s = Instant::now();
        let t = acked(s, s + Duration::from_millis(5));
        let late = s + Duration::from_millis(3100);
        let (kind, _) = rules().judge(&t, &t, late, late, &Seen::Online).unwrap();
        assert_eq!(kind, WrongKind::OnlineAfterSilence);
        assert!(rules()
            .judge(&t, &t, s + Duration::from_millis(2900), late, &Seen::Online)
            .is_none());
        let mut flying = t;
        flying.inflight = true;
        assert!(rules()
            .judge(&flying, &t, late, late, &Seen::Online)
            .is_none());
        let mut later = t;
        later.sent = 2;
        assert!(rules()
            .judge(&t, &later, late, late, &Seen::Online)
            .is_none());
    }

    #[test]
    fn online_after_logout_and_missing_users_are_wrong() {
        let s = Instant::now();
        let mut t = acked(s, s + Duration::from_millis(5));
        t.logout_started = Some(s + Duration::from_millis(10));
        t.logout_acked = Some(s + Duration::from_millis(20));
        let g0 = s + Duration::from_millis(30);
        assert_eq!(
            rules().judge(&t, &t, g0, g0, &Seen::Online).unwrap().0,
            WrongKind::OnlineAfterLogout
        );
        assert_eq!(
            rules().judge(&t, &t, g0, g0, &Seen::Missing).unwrap().0,
            WrongKind::Missing
        );
        let fresh = Track::default();
        assert!(rules()
            .judge(&fresh, &fresh, g0, g0, &Seen::Missing)
            .is_none());
    }
}
