//! Printing results, the committed baseline, and the gate (`check`).

use std::collections::BTreeSet;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::probe::Statement;
use crate::scenarios::{self, Measurement, Scenario};
use crate::BoxError;

/// Tolerance on WAL records per run: a checkpoint, a standby snapshot or a page split
/// landing differently moves the count a little; a new record per message moves it a lot.
pub const WAL_RECORDS_TOLERANCE: f64 = 0.10;

/// Where and when figures were taken.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct Machine {
    pub date: String,
    pub cpu: String,
    pub cores: usize,
    pub memory: String,
    pub kernel: String,
    pub postgres: String,
    pub server: String,
}

impl Machine {
    /// The PostgreSQL major of [`Machine::postgres`] (`PostgreSQL 15.20 (Debian …)` is 15).
    pub fn postgres_major(&self) -> Option<u32> {
        self.postgres
            .split_whitespace()
            .skip_while(|w| *w != "PostgreSQL")
            .nth(1)?
            .split('.')
            .next()?
            .parse()
            .ok()
    }

    pub fn read(postgres: &str, server: &str) -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| {
                l.strip_prefix("model name")
                    .map(|r| r.trim_start_matches([' ', '\t', ':']).to_owned())
            })
            .unwrap_or_default();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let memory = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:").map(|r| r.trim().to_owned()))
            .unwrap_or_default();
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_owned();
        Machine {
            date: chrono::Utc::now().format("%Y-%m-%d %H:%M UTC").to_string(),
            cpu,
            cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
            memory,
            kernel,
            postgres: postgres.to_owned(),
            server: server.to_owned(),
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "{} · {} cores ({}) · {} RAM · Linux {} · {} · {}",
            self.date, self.cores, self.cpu, self.memory, self.kernel, self.postgres, self.server
        )
    }
}

/// What each scenario's gate covers, for readers of the baseline file.
fn gated_figures(sc: &Scenario) -> Vec<String> {
    let mut g = Vec::new();
    match sc.ungated_statements() {
        None => {}
        Some([]) => g.push("statements (exact)".to_owned()),
        Some(skip) => {
            g.push(format!("statements except {} (exact)", skip.join(", ")));
            for k in skip.iter() {
                if let Some((lo, hi)) = sc.statement_range(k) {
                    g.push(format!("statements[{k}] within [{lo}, {hi}]"));
                }
            }
        }
    }
    if sc.gates_tuples_and_wal() {
        g.push(format!("tuples {} (exact)", sc.gated_tuples().join("/")));
        g.push(format!(
            "wal.records (+{:.0} %)",
            WAL_RECORDS_TOLERANCE * 100.0
        ));
    }
    g
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BaselineEntry {
    #[serde(flatten)]
    pub m: Measurement,
    /// Informational: which of the figures `check` compares.
    #[serde(default)]
    pub gated: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Baseline {
    pub about: String,
    pub machine: Machine,
    pub scenarios: Vec<BaselineEntry>,
}

impl Baseline {
    pub fn new(machine: Machine, results: &[Measurement]) -> Baseline {
        Baseline {
            about: "outbox-bench baseline (SPEC §12). `cargo run -p outbox-bench -- check` (any \
                    profile; CI runs it) compares statement and tuple counts exactly and WAL \
                    records within +10 %, as each entry's `gated` lists; msgs_per_second, WAL \
                    bytes/FPI, lateness and the `…/async` (synchronous_commit off) variants are \
                    informational. Recorded with the worker's pool at test_before_acquire(false). \
                    Re-record with `cargo run --release -p outbox-bench -- run --write-baseline`."
                .to_owned(),
            machine,
            scenarios: results
                .iter()
                .map(|m| BaselineEntry {
                    m: m.clone(),
                    gated: scenarios::find(&m.scenario)
                        .map(gated_figures)
                        .unwrap_or_default(),
                })
                .collect(),
        }
    }

    pub fn load(path: &Path) -> Result<Baseline, BoxError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading the baseline {}: {e}", path.display()))?;
        Ok(serde_json::from_str(&text)
            .map_err(|e| format!("parsing the baseline {}: {e}", path.display()))?)
    }

    pub fn save(&self, path: &Path) -> Result<(), BoxError> {
        let mut text = serde_json::to_string_pretty(self)?;
        text.push('\n');
        std::fs::write(path, text)?;
        Ok(())
    }
}

/// One failed comparison.
#[derive(Debug)]
pub struct Regression {
    pub scenario: String,
    pub metric: String,
    pub baseline: String,
    pub current: String,
    pub why: String,
}

/// Compares `current` with `baseline`; returns the regressions and prints a line per
/// scenario.
pub fn compare(baseline: &Baseline, current: &[Measurement]) -> Vec<Regression> {
    let mut out = Vec::new();
    for cur in current {
        let Some(sc) = scenarios::find(&cur.scenario) else {
            continue;
        };
        // An idle worker's load is bounded, not compared with a baseline: any statement in
        // the window is a poll, and the bound is the design's (sleep until the earliest
        // deadline, issue 27).
        if let Some(i) = cur.idle {
            let ok = i.statements_per_second <= scenarios::IDLE_STATEMENTS_PER_SECOND_MAX;
            println!(
                "  {} {:<26} idle {:.1} statements/s (at most {:.0})",
                if ok { "ok  " } else { "FAIL" },
                cur.scenario,
                i.statements_per_second,
                scenarios::IDLE_STATEMENTS_PER_SECOND_MAX
            );
            if !ok {
                out.push(Regression {
                    scenario: cur.scenario.clone(),
                    metric: "idle statements/s".into(),
                    baseline: format!("at most {}", scenarios::IDLE_STATEMENTS_PER_SECOND_MAX),
                    current: format!("{:.1}", i.statements_per_second),
                    why: "an idle worker polls".into(),
                });
            }
            continue;
        }
        let Some(base) = baseline
            .scenarios
            .iter()
            .find(|b| b.m.scenario == cur.scenario)
        else {
            println!(
                "  new  {:<26} not in the baseline; record it with run --write-baseline",
                cur.scenario
            );
            continue;
        };
        let base = &base.m;
        let before = out.len();
        let mut push = |metric: String, b: String, c: String, why: &str| {
            out.push(Regression {
                scenario: cur.scenario.clone(),
                metric,
                baseline: b,
                current: c,
                why: why.to_owned(),
            })
        };

        if base.messages != cur.messages {
            push(
                "messages".into(),
                base.messages.to_string(),
                cur.messages.to_string(),
                "different workload",
            );
        }
        if let Some(skip) = sc.ungated_statements() {
            let kinds: BTreeSet<&String> = base
                .statements
                .keys()
                .chain(cur.statements.keys())
                .collect();
            for k in kinds {
                if skip.contains(&k.as_str()) {
                    // Timing-dependent: gated as a range (SPEC §12 v2).
                    if let Some((lo, hi)) = sc.statement_range(k) {
                        let c = cur.statements.get(k).copied().unwrap_or(0);
                        if c < lo || c > hi {
                            push(
                                format!("statements[{k}]"),
                                format!("[{lo}, {hi}]"),
                                c.to_string(),
                                "outside the range the coalescing allows",
                            );
                        }
                    }
                    continue;
                }
                let b = base.statements.get(k).copied().unwrap_or(0);
                let c = cur.statements.get(k).copied().unwrap_or(0);
                if b != c {
                    let why = if c > b {
                        "more statements: a regression"
                    } else {
                        "fewer statements: an improvement; re-record the baseline"
                    };
                    push(
                        format!("statements[{k}]"),
                        b.to_string(),
                        c.to_string(),
                        why,
                    );
                }
            }
        }
        if sc.gates_tuples_and_wal() {
            for f in sc.gated_tuples() {
                let (b, c) = (tuple_field(&base.tuples, f), tuple_field(&cur.tuples, f));
                if b != c {
                    push(
                        format!("tuples.{f}"),
                        b.to_string(),
                        c.to_string(),
                        "tuple counts must match exactly",
                    );
                }
            }
            // A timing-dependent statement that ran more often than in the baseline wrote
            // one more commit record each (the rows it changed are counted either way).
            let extra_commits: i64 = sc
                .ungated_statements()
                .unwrap_or(&[])
                .iter()
                .filter(|k| sc.statement_range(k).is_some())
                .map(|k| {
                    let b = base.statements.get(*k).copied().unwrap_or(0);
                    let c = cur.statements.get(*k).copied().unwrap_or(0);
                    (c - b).max(0)
                })
                .sum();
            let limit =
                base.wal.records as f64 * (1.0 + WAL_RECORDS_TOLERANCE) + extra_commits as f64;
            if cur.wal.records as f64 > limit {
                push(
                    "wal.records".into(),
                    base.wal.records.to_string(),
                    cur.wal.records.to_string(),
                    &format!(
                        "more than +{:.0} % ({:+.1} %)",
                        WAL_RECORDS_TOLERANCE * 100.0,
                        pct(base.wal.records as f64, cur.wal.records as f64)
                    ),
                );
            }
        }
        let status = if out.len() == before { "ok  " } else { "FAIL" };
        let tput = if sc.has_throughput() {
            format!(
                "{:.0} msg/s (baseline {:.0}, {:.2}×, informational)",
                cur.msgs_per_second,
                base.msgs_per_second,
                cur.msgs_per_second / base.msgs_per_second
            )
        } else {
            match (cur.lateness_ms, cur.idle) {
                (Some(l), _) => format!("lateness p99 {:.1} ms (informational)", l.p99),
                (None, Some(i)) => format!(
                    "idle {:.1} statements/s (at most {:.0})",
                    i.statements_per_second,
                    scenarios::IDLE_STATEMENTS_PER_SECOND_MAX
                ),
                (None, None) => String::new(),
            }
        };
        println!(
            "  {status} {:<26} statements {} (baseline {}), WAL records {} ({:+.1} %), {tput}",
            cur.scenario,
            cur.statements_total(),
            base.statements_total(),
            cur.wal.records,
            pct(base.wal.records as f64, cur.wal.records as f64),
        );
    }
    out
}

/// The gated counts (statements by kind, tuples) in which two runs of `sc` differ, as
/// `name a → b`; timing-dependent counts, which are not gated, are left out.
pub fn gated_counts_differ(sc: &Scenario, a: &Measurement, b: &Measurement) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(skip) = sc.ungated_statements() {
        let kinds: BTreeSet<&String> = a.statements.keys().chain(b.statements.keys()).collect();
        for k in kinds.into_iter().filter(|k| !skip.contains(&k.as_str())) {
            let (x, y) = (
                a.statements.get(k).copied().unwrap_or(0),
                b.statements.get(k).copied().unwrap_or(0),
            );
            if x != y {
                out.push(format!("statements[{k}] {x} → {y}"));
            }
        }
    }
    for f in sc.gated_tuples() {
        let (x, y) = (tuple_field(&a.tuples, f), tuple_field(&b.tuples, f));
        if x != y {
            out.push(format!("tuples.{f} {x} → {y}"));
        }
    }
    out
}

fn pct(base: f64, cur: f64) -> f64 {
    if base == 0.0 {
        0.0
    } else {
        (cur / base - 1.0) * 100.0
    }
}

pub fn tuple_field(t: &crate::probe::Tuples, f: &str) -> i64 {
    match f {
        "ins" => t.ins,
        "upd" => t.upd,
        "del" => t.del,
        "hot_upd" => t.hot_upd,
        "dead" => t.dead,
        _ => 0,
    }
}

/// The per-scenario block printed after each run.
pub fn print_block(m: &Measurement, statements: &[Statement], verbose: bool) {
    let n = m.messages as f64;
    let sc = scenarios::find(&m.scenario);
    if sc.is_some_and(|s| !s.has_throughput()) {
        println!(
            "{}  {} timers  ({:.2} s window)",
            m.scenario, m.messages, m.wall_seconds
        );
    } else {
        println!(
            "{}  {} msgs  {:.0} msg/s  ({:.3} s)",
            m.scenario, m.messages, m.msgs_per_second, m.wall_seconds
        );
    }
    let kinds: Vec<String> = m
        .statements
        .iter()
        .map(|(k, c)| format!("{k} {:.4}", *c as f64 / n))
        .collect();
    println!(
        "  statements/msg {:.4}: {}",
        m.statements_total() as f64 / n,
        kinds.join("  ")
    );
    println!(
        "  WAL/msg: {:.2} records, {:.0} bytes, {:.3} FPI",
        m.wal.records as f64 / n,
        m.wal.bytes as f64 / n,
        m.wal.fpi as f64 / n
    );
    let t = m.tuples;
    println!(
        "  tuples: ins {}  upd {}  del {}  hot_upd {}  dead {}",
        t.ins, t.upd, t.del, t.hot_upd, t.dead
    );
    if let Some(cpu) = m.client_cpu_seconds {
        println!(
            "  client CPU (this process, seeding included): {:.2} s, {:.0} µs/msg",
            cpu,
            cpu * 1e6 / n
        );
    }
    if let Some(i) = m.idle {
        println!(
            "  idle worker: {:.2} statements/s over {:.1} s",
            i.statements_per_second, i.window_seconds
        );
    }
    if let Some(l) = m.lateness_ms {
        println!(
            "  lateness (handler start − deadline): p50 {:.1} ms  p99 {:.1} ms  max {:.1} ms  (claim − deadline p99 {:.1} ms)",
            l.p50, l.p99, l.max, l.claim_p99
        );
    }
    if verbose {
        for s in statements {
            println!(
                "    {:>7} calls {:>7} rows {:>9.1} ms {:>6} wal rec {:>9} wal B  {}",
                s.calls,
                s.rows,
                s.total_ms,
                s.wal_records,
                s.wal_bytes,
                shorten(&s.query, 150)
            );
        }
    }
}

pub fn shorten(q: &str, max: usize) -> String {
    let one: String = q.split_whitespace().collect::<Vec<_>>().join(" ");
    if one.chars().count() <= max {
        one
    } else {
        format!("{}…", one.chars().take(max).collect::<String>())
    }
}

/// The summary table, as Markdown (pasted into the lab notes, `docs/lab-notes/`).
pub fn summary_table(results: &[Measurement]) -> String {
    let mut s = String::from(
        "| scenario | msg/s | statements/msg (by kind) | WAL rec/msg | WAL B/msg | FPI/msg | ins | upd | del | hot upd | dead |\n\
         |---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for m in results {
        let n = m.messages as f64;
        let kinds: Vec<String> = m
            .statements
            .iter()
            .map(|(k, c)| format!("{k} {}", trim(*c as f64 / n)))
            .collect();
        let tput = match (
            scenarios::find(&m.scenario).is_some_and(|s| s.has_throughput()),
            m.lateness_ms,
        ) {
            (true, _) => format!("{:.0}", m.msgs_per_second),
            (false, Some(l)) => format!("p50/p99/max {:.0}/{:.0}/{:.0} ms", l.p50, l.p99, l.max),
            (false, None) => match m.idle {
                Some(i) => format!("idle {:.1} stmt/s", i.statements_per_second),
                None => "–".to_owned(),
            },
        };
        s.push_str(&format!(
            "| {} | {} | {} ({}) | {:.2} | {:.0} | {:.3} | {} | {} | {} | {} | {} |\n",
            m.scenario,
            tput,
            trim(m.statements_total() as f64 / n),
            kinds.join(", "),
            m.wal.records as f64 / n,
            m.wal.bytes as f64 / n,
            m.wal.fpi as f64 / n,
            m.tuples.ins,
            m.tuples.upd,
            m.tuples.del,
            m.tuples.hot_upd,
            m.tuples.dead,
        ));
    }
    s
}

/// The consumers, producers and extends against the per-commit limit measured in the same
/// sitting (`limit/commit`, a one-row insert per transaction): how far pipelined acks take a
/// consumer past one durable commit per message, and how close a publish or an extend that
/// commits once per message comes to it. `None` when the limit was not measured.
pub fn against_commit_limit(results: &[Measurement]) -> Option<String> {
    let limit = results.iter().find(|m| m.scenario == "limit/commit")?;
    let mut out = format!(
        "per-commit limit (one-row insert per transaction, one connection): {:.0} msg/s",
        limit.msgs_per_second
    );
    for m in results.iter().filter(|m| {
        ["consumer/", "producer/", "extend/"]
            .iter()
            .any(|p| m.scenario.starts_with(p))
            && !m.scenario.ends_with("/async")
    }) {
        out.push_str(&format!(
            "\n  {:<26} {:>8.0} msg/s = {:.2}× the per-commit limit",
            m.scenario,
            m.msgs_per_second,
            m.msgs_per_second / limit.msgs_per_second
        ));
    }
    Some(out)
}

/// Four decimals without trailing zeros.
pub fn trim(x: f64) -> String {
    let s = format!("{x:.4}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::Tuples;
    use crate::scenarios::WalTotals;

    #[test]
    fn the_postgres_major_of_a_machine() {
        let of = |postgres: &str| Machine::read(postgres, "").postgres_major();
        assert_eq!(of("PostgreSQL 15.20 (Debian 15.20-0+deb12u1)"), Some(15));
        assert_eq!(of("PostgreSQL 18.4"), Some(18));
        assert_eq!(of("something else"), None);
    }

    /// The per-row-ack consumer: every count gated exactly.
    const EXACT: &str = "consumer/w1/b10/ack1";
    /// The pipelined consumer: its DELETE count gated as a range.
    const COALESCED: &str = "consumer/w1/b10";

    fn m(delete: i64, wal_records: i64, tput: f64) -> Measurement {
        on(EXACT, delete, wal_records, tput)
    }

    fn on(scenario: &str, delete: i64, wal_records: i64, tput: f64) -> Measurement {
        Measurement {
            scenario: scenario.to_owned(),
            messages: 5000,
            wall_seconds: 1.0,
            msgs_per_second: tput,
            statements: [
                ("DELETE".to_owned(), delete),
                ("WITH…UPDATE".to_owned(), 501),
            ]
            .into_iter()
            .collect(),
            wal: WalTotals {
                records: wal_records,
                bytes: 1,
                fpi: 0,
            },
            tuples: Tuples {
                ins: 0,
                upd: 5000,
                del: 5000,
                hot_upd: 0,
                dead: 10000,
            },
            lateness_ms: None,
            idle: None,
            client_cpu_seconds: None,
        }
    }

    fn baseline() -> Baseline {
        Baseline::new(Machine::default(), &[m(5000, 30000, 2000.0)])
    }

    #[test]
    fn same_counts_slower_pass() {
        assert!(compare(&baseline(), &[m(5000, 32900, 900.0)]).is_empty());
    }

    #[test]
    fn one_more_statement_fails_naming_everything() {
        let r = compare(&baseline(), &[m(5001, 30000, 2000.0)]);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].scenario, EXACT);
        assert_eq!(r[0].metric, "statements[DELETE]");
        assert_eq!(
            (r[0].baseline.as_str(), r[0].current.as_str()),
            ("5000", "5001")
        );
    }

    #[test]
    fn wal_records_beyond_ten_percent_fail() {
        let r = compare(&baseline(), &[m(5000, 33001, 2000.0)]);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].metric, "wal.records");
    }

    #[test]
    fn tuple_counts_are_exact() {
        let mut cur = m(5000, 30000, 2000.0);
        cur.tuples.dead += 1;
        let r = compare(&baseline(), &[cur]);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].metric, "tuples.dead");
    }

    #[test]
    fn a_coalesced_delete_count_is_gated_as_a_range() {
        let base = Baseline::new(Machine::default(), &[on(COALESCED, 700, 30000, 9000.0)]);
        // ceil(5000 / 100) = 50 ..= 5000 statements pass, whatever the baseline's count.
        for ok in [50, 700, 2500, 5000] {
            let extra = (ok - 700).max(0);
            let r = compare(&base, &[on(COALESCED, ok, 30000 + extra, 9000.0)]);
            assert!(r.is_empty(), "{ok}: {r:?}");
        }
        for bad in [49, 5001] {
            let r = compare(&base, &[on(COALESCED, bad, 30000, 9000.0)]);
            assert_eq!(r.len(), 1, "{bad}: {r:?}");
            assert_eq!(r[0].metric, "statements[DELETE]");
            assert_eq!(r[0].baseline, "[50, 5000]");
        }
        // More statements than the baseline allow one commit record each, and no more.
        let r = compare(&base, &[on(COALESCED, 1700, 33000 + 1000, 9000.0)]);
        assert!(r.is_empty(), "{r:?}");
        let r = compare(&base, &[on(COALESCED, 1700, 33000 + 1001, 9000.0)]);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].metric, "wal.records");
    }

    /// Found by CI on a busy machine: two completions of `extend/rearm` written in one
    /// batch made 499 `DELETE`s and 5499 settles where the baseline has 500 and 5500.
    #[test]
    fn the_rearm_completions_are_gated_as_ranges() {
        let rearm = |delete: i64, settle: i64| {
            let mut m = on("extend/rearm", delete, 30000, 2000.0);
            m.statements.insert("WITH…SELECT".to_owned(), settle);
            m
        };
        let base = Baseline::new(Machine::default(), &[rearm(500, 5500)]);
        for (d, w) in [(500, 5500), (499, 5499), (5, 5005)] {
            let r = compare(&base, &[rearm(d, w)]);
            assert!(r.is_empty(), "{d}/{w}: {r:?}");
        }
        let r = compare(&base, &[rearm(501, 5501)]);
        assert_eq!(r.len(), 2, "{r:?}");
        assert_eq!(r[0].baseline, "[5, 500]");
        assert_eq!(r[1].baseline, "[5005, 5500]");
        // Every other statement stays exact.
        let mut more = rearm(500, 5500);
        more.statements.insert("WITH…UPDATE".to_owned(), 502);
        assert_eq!(compare(&base, &[more]).len(), 1);
    }

    #[test]
    fn baseline_round_trips() {
        let b = baseline();
        let text = serde_json::to_string(&b).unwrap();
        let back: Baseline = serde_json::from_str(&text).unwrap();
        assert_eq!(back.scenarios[0].m, b.scenarios[0].m);
        assert!(text.contains("statements (exact)"));
    }
}
