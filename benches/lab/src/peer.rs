//! `--vs-peer CMD`: the same scenarios run by another implementation (here the Python
//! reference, `shared/peer/peer_bench.py`) on the same server in the same sitting.
//!
//! `CMD` is run with `sh -c` after substituting `{dsn}` (`postgres://…`), `{host}`,
//! `{port}` and `{only}`; the same values are in the environment as `OUTBOX_BENCH_DSN`,
//! `OUTBOX_BENCH_HOST`, `OUTBOX_BENCH_PORT`, `OUTBOX_BENCH_ONLY`. It must print one JSON
//! object per scenario on stdout with at least `scenario` and `msgs_per_second` (or
//! `lateness_ms_p50`/`_p99`/`_max`), as the reference does.
//!
//! When `CMD` contains `{only}` it is run once per scenario, right after ours, and the
//! harness measures the command's database work itself: WAL from `pg_stat_wal` and the
//! statements from `pg_stat_statements` around it. The reference creates, seeds and drops
//! its table inside the command, so the WAL and statements of that set-up (DDL, catalog
//! queries, the seeding `INSERT`s, the final count) are subtracted by statement, which
//! `pg_stat_statements` reports with their WAL; what is left is its measured phase plus a
//! handful of set-up commit records (a few hundred bytes in a run of 5000 messages).

use sqlx::AssertSqlSafe;
use std::collections::BTreeMap;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use tokio::io::AsyncReadExt;

use outbox_bench::probe::{self, Statement};
use outbox_bench::report::{shorten, trim};
use outbox_bench::run::Alongside;
use outbox_bench::scenarios::{self, Env, Kind, Measurement, Scenario, WalTotals};
use outbox_bench::session::Session;
use outbox_bench::BoxError;

/// The reference's figures for one of its scenarios.
#[derive(Debug, Clone)]
pub struct PeerResult {
    pub scenario: String,
    pub messages: u64,
    pub msgs_per_second: Option<f64>,
    pub lateness_ms: Option<scenarios::Lateness>,
    /// What the harness measured around the command (only with `{only}`).
    pub phase: Option<Phase>,
}

impl PeerResult {
    /// What runs are ranked by when picking the median.
    pub fn rank(&self) -> f64 {
        match (self.msgs_per_second, self.lateness_ms) {
            (Some(t), _) => t,
            (None, Some(l)) => l.p99,
            _ => 0.0,
        }
    }

    pub fn headline(&self) -> String {
        match (self.msgs_per_second, self.lateness_ms) {
            (Some(t), _) => format!("{t:.0} msg/s"),
            (None, Some(l)) => format!(
                "lateness p50 {:.0} p99 {:.0} max {:.0} ms",
                l.p50, l.p99, l.max
            ),
            _ => "no figure".to_owned(),
        }
    }
}

/// The reference's measured phase, as seen by the server.
#[derive(Debug, Clone)]
pub struct Phase {
    pub statements: BTreeMap<String, i64>,
    pub wal: WalTotals,
}

impl Phase {
    pub fn statements_total(&self) -> i64 {
        self.statements.values().sum()
    }
}

pub struct Target {
    pub host: String,
    pub port: u16,
    pub dsn: String,
}

impl Target {
    fn of(session: &Session) -> Target {
        Target {
            host: session.env.opts.get_host().to_owned(),
            port: session.env.opts.get_port(),
            dsn: session.dsn.clone(),
        }
    }
}

/// `run --vs-peer CMD`: the reference alongside the scenarios. With `{only}` in `CMD` it
/// runs after each of our runs of a scenario it shares (so the two alternate) and reports
/// its median; without, once after all of ours. Then the side-by-side table.
pub struct Reference {
    template: String,
    verbose: bool,
    /// The reference's runs of the current scenario.
    runs: Vec<Vec<PeerResult>>,
    /// Its median per scenario, or the one run without `{only}`.
    medians: Vec<PeerResult>,
}

impl Reference {
    pub fn new(template: &str, verbose: bool) -> Reference {
        Reference {
            template: template.to_owned(),
            verbose,
            runs: Vec::new(),
            medians: Vec::new(),
        }
    }

    fn per_scenario(&self) -> bool {
        self.template.contains("{only}")
    }
}

impl Alongside for Reference {
    async fn after_run(
        &mut self,
        session: &mut Session,
        sc: &Scenario,
        r: usize,
    ) -> Result<(), BoxError> {
        if !self.per_scenario() || sc.peer.is_empty() {
            return Ok(());
        }
        let target = Target::of(session);
        let got = run(
            &mut session.env,
            &self.template,
            &target,
            Some(sc),
            self.verbose,
        )
        .await?;
        for p in &got {
            eprintln!("  reference {} run {}: {}", p.scenario, r + 1, p.headline());
        }
        self.runs.push(got);
        Ok(())
    }

    fn after_scenario(&mut self, sc: &Scenario) {
        for name in sc.peer {
            let mut same: Vec<PeerResult> = self
                .runs
                .iter()
                .flatten()
                .filter(|p| p.scenario == *name)
                .cloned()
                .collect();
            if same.is_empty() {
                continue;
            }
            same.sort_by(|a, b| a.rank().total_cmp(&b.rank()));
            let p = same.swap_remove(same.len() / 2);
            println!("  reference {}: {}", p.scenario, p.headline());
            self.medians.push(p);
        }
        self.runs.clear();
    }

    async fn after_all(
        &mut self,
        session: &mut Session,
        results: &[Measurement],
    ) -> Result<(), BoxError> {
        if !self.per_scenario() {
            let target = Target::of(session);
            self.medians = run(
                &mut session.env,
                &self.template,
                &target,
                None,
                self.verbose,
            )
            .await?;
        }
        if !self.medians.is_empty() {
            println!("outbox vs reference (same server, same sitting):\n");
            println!("{}", peer_table(results, &self.medians));
        }
        Ok(())
    }
}

/// Runs `template` for one scenario (with `{only}`) or for all (without).
pub async fn run(
    env: &mut Env,
    template: &str,
    target: &Target,
    sc: Option<&Scenario>,
    verbose: bool,
) -> Result<Vec<PeerResult>, BoxError> {
    let only = sc.map(|s| s.peer.join(",")).unwrap_or_default();
    let cmd = template
        .replace("{dsn}", &target.dsn)
        .replace("{host}", &target.host)
        .replace("{port}", &target.port.to_string())
        .replace("{only}", &only);
    let measure = sc.is_some();
    let mut wal0 = None;
    // Backends the command opens start after this; on a shared server (--dsn) they are
    // the only ones waited for.
    let started: String = sqlx::query_scalar(AssertSqlSafe(probe::tagged(
        "SELECT clock_timestamp()::text",
    )))
    .fetch_one(&mut env.probe)
    .await?;
    if measure {
        sqlx::raw_sql(AssertSqlSafe(probe::tagged("CHECKPOINT")))
            .execute(&mut env.probe)
            .await?;
        wal0 = Some(probe::wal(&mut env.probe).await?);
        probe::reset_statements(&mut env.probe).await?;
    }
    eprintln!("peer: {cmd}");
    let mut child = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(&cmd)
        .env("OUTBOX_BENCH_DSN", &target.dsn)
        .env("OUTBOX_BENCH_HOST", &target.host)
        .env("OUTBOX_BENCH_PORT", target.port.to_string())
        .env("OUTBOX_BENCH_ONLY", &only)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()?;
    let mut stdout = child.stdout.take().ok_or("no stdout")?;
    let mut text = String::new();
    let read = async {
        stdout.read_to_string(&mut text).await?;
        child.wait().await
    };
    let status = tokio::time::timeout(Duration::from_secs(1800), read)
        .await
        .map_err(|_| "the peer command did not finish within 30 minutes")??;
    if !status.success() {
        return Err(format!("the peer command failed ({status}): {cmd}").into());
    }
    let mut results = parse(&text);
    if let (Some(sc), Some(wal0)) = (sc, wal0) {
        // Its connections' statistics are flushed when their backends exit.
        probe::wait_backends_gone(
            &mut env.probe,
            &format!(
                "datname = current_database() AND application_name NOT LIKE 'outbox-bench%' \
                 AND backend_start >= '{started}'::timestamptz"
            ),
            false,
        )
        .await?;
        let statements = probe::statements(&mut env.probe).await?;
        let wal1 = probe::wal(&mut env.probe).await?;
        let total = scenarios::wal_diff(&wal0, &wal1);
        let (phase, setup): (Vec<&Statement>, Vec<&Statement>) =
            statements.iter().partition(|s| !is_setup(sc, s));
        let mut wal = total;
        for s in &setup {
            wal.records -= s.wal_records;
            wal.bytes -= s.wal_bytes;
            wal.fpi -= s.wal_fpi;
        }
        if verbose {
            println!("  reference statements ({}):", sc.name);
            for (tag, list) in [("phase", &phase), ("setup", &setup)] {
                for s in list.iter() {
                    println!(
                        "    {tag} {:>7} calls {:>7} rows {:>6} wal rec {:>9} wal B  {}",
                        s.calls,
                        s.rows,
                        s.wal_records,
                        s.wal_bytes,
                        shorten(&s.query, 140)
                    );
                }
            }
            println!(
                "    WAL in the command: {} records, {} bytes, {} FPI; set-up statements' share subtracted",
                total.records, total.bytes, total.fpi
            );
        }
        let mut by_kind = BTreeMap::new();
        for s in &phase {
            *by_kind.entry(s.keyword()).or_insert(0) += s.calls;
        }
        // One command for two lateness scenarios: WAL per scenario is not separable, and
        // nothing in a lateness run is per-message work worth comparing.
        if sc.kind != Kind::Lateness {
            for r in &mut results {
                r.phase = Some(Phase {
                    statements: by_kind.clone(),
                    wal,
                });
            }
        }
    }
    Ok(results)
}

/// Statements of the reference's set-up rather than its measured phase.
fn is_setup(sc: &Scenario, s: &Statement) -> bool {
    let q = s.query.to_ascii_lowercase();
    let kw = s.keyword();
    if matches!(
        kw.as_str(),
        "CREATE" | "ALTER" | "DROP" | "CHECKPOINT" | "TRUNCATE" | "COMMENT"
    ) {
        return true;
    }
    // SQLAlchemy's table reflection for create_all/drop_all.
    if q.contains("pg_catalog.") || q.contains("information_schema") {
        return true;
    }
    match sc.kind {
        // Seeding and the final count of rows left.
        // (the handlers' inserts into the application table are measured).
        Kind::Consumer { tx, .. } => {
            (kw == "INSERT" && !(tx && q.contains("_effects"))) || q.contains("count(*)")
        }
        // The timers are seeded with plain publishes (ON CONFLICT DO NOTHING); the
        // measured extends are ON CONFLICT DO UPDATE.
        Kind::ExtendPending { .. } => kw.contains("INSERT") && !q.contains("do update"),
        _ => false,
    }
}

fn parse(stdout: &str) -> Vec<PeerResult> {
    let mut out = Vec::new();
    for line in stdout.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line.trim()) else {
            continue;
        };
        let Some(name) = v.get("scenario").and_then(Value::as_str) else {
            continue;
        };
        let f = |k: &str| v.get(k).and_then(Value::as_f64);
        let lateness = match (
            f("lateness_ms_p50"),
            f("lateness_ms_p99"),
            f("lateness_ms_max"),
        ) {
            (Some(p50), Some(p99), Some(max)) => Some(scenarios::Lateness {
                p50,
                p99,
                max,
                claim_p99: f64::NAN,
            }),
            _ => None,
        };
        out.push(PeerResult {
            scenario: name.to_owned(),
            messages: v.get("messages").and_then(Value::as_u64).unwrap_or(0),
            msgs_per_second: f("msgs_per_second"),
            lateness_ms: lateness,
            phase: None,
        });
    }
    out
}

/// Ours against the reference, per shared scenario, as Markdown. The `…/async` variant
/// of a scenario, when it ran, is shown in its own informational columns.
pub fn peer_table(ours: &[Measurement], peers: &[PeerResult]) -> String {
    let mut s = String::from(
        "| scenario | outbox msg/s | reference msg/s | ratio | outbox async-commit msg/s (informational) | async-commit ratio (informational) | outbox stmts/msg | reference stmts/msg | outbox WAL B/msg | reference WAL B/msg | WAL ratio |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for p in peers {
        let Some(sc) = scenarios::ALL
            .iter()
            .find(|s| s.peer.contains(&p.scenario.as_str()))
        else {
            continue;
        };
        let Some(m) = ours.iter().find(|m| m.scenario == sc.name) else {
            continue;
        };
        let n = m.messages as f64;
        if let (Some(l), Some(pl)) = (m.lateness_ms, p.lateness_ms) {
            s.push_str(&format!(
                "| {} vs {} | lateness p50/p99/max {:.0}/{:.0}/{:.0} ms | {:.0}/{:.0}/{:.0} ms | p99 {:.0}× lower | | | | | | | |\n",
                m.scenario, p.scenario, l.p50, l.p99, l.max, pl.p50, pl.p99, pl.max,
                pl.p99 / l.p99.max(0.001)
            ));
            continue;
        }
        let Some(pt) = p.msgs_per_second else {
            continue;
        };
        let our_wal = m.wal.bytes as f64 / n;
        let (peer_stmts, peer_wal, wal_ratio) = match (&p.phase, p.messages) {
            (Some(ph), pn) if pn > 0 => {
                let pn = pn as f64;
                let w = ph.wal.bytes as f64 / pn;
                (
                    trim(ph.statements_total() as f64 / pn),
                    format!("{w:.0}"),
                    format!("{:.2}", our_wal / w),
                )
            }
            _ => ("–".into(), "–".into(), "–".into()),
        };
        let (async_tput, async_ratio) = match scenarios::async_variant(sc.name)
            .and_then(|v| ours.iter().find(|m| m.scenario == v.name))
        {
            Some(a) => (
                format!("{:.0}", a.msgs_per_second),
                format!("{:.2}×", a.msgs_per_second / pt),
            ),
            None => ("–".into(), "–".into()),
        };
        s.push_str(&format!(
            "| {} | {:.0} | {:.0} | **{:.2}×** | {} | {} | {} | {} | {:.0} | {} | {} |\n",
            m.scenario,
            m.msgs_per_second,
            pt,
            m.msgs_per_second / pt,
            async_tput,
            async_ratio,
            trim(m.statements_total() as f64 / n),
            peer_stmts,
            our_wal,
            peer_wal,
            wal_ratio,
        ));
    }
    s
}
