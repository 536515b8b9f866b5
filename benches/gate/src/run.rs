//! `run` and `check`: the selected scenarios on one server, each repeated and reported by
//! its median run, then the summary; `run` writes the JSON lines and the baseline, `check`
//! compares with the baseline. The lab runs the same loop with the reference alongside
//! (an [`Alongside`]).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Args;

use crate::report::{self, Baseline};
use crate::scenarios::{self, Measurement, Scenario};
use crate::session::{Common, Session};
use crate::BoxError;

/// `run`: every scenario (or `--only`), printed per scenario and as a Markdown table.
#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub common: Common,
    /// Runs each scenario this many times and reports the run with the median throughput;
    /// counts that differ between repeats are reported (they must not).
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Writes the results to the baseline file.
    #[arg(long)]
    pub write_baseline: bool,
    /// Writes every measurement as one JSON object per line to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// `check`: the gated scenarios against the baseline.
#[derive(Args, Debug)]
pub struct CheckArgs {
    #[command(flatten)]
    pub common: Common,
}

/// Work run in the same sitting as the scenarios, on the same server (the lab's
/// reference comparison); `()` runs nothing.
pub trait Alongside {
    /// After run `r` (from 0) of `sc`.
    fn after_run(
        &mut self,
        session: &mut Session,
        sc: &Scenario,
        r: usize,
    ) -> impl Future<Output = Result<(), BoxError>>;
    /// After the repeats of `sc`, its median block printed.
    fn after_scenario(&mut self, sc: &Scenario);
    /// After every scenario and the summary table.
    fn after_all(
        &mut self,
        session: &mut Session,
        results: &[Measurement],
    ) -> impl Future<Output = Result<(), BoxError>>;
}

impl Alongside for () {
    async fn after_run(&mut self, _: &mut Session, _: &Scenario, _: usize) -> Result<(), BoxError> {
        Ok(())
    }

    fn after_scenario(&mut self, _: &Scenario) {}

    async fn after_all(&mut self, _: &mut Session, _: &[Measurement]) -> Result<(), BoxError> {
        Ok(())
    }
}

/// Refuses the `run` options that would record a baseline of something other than the
/// product as shipped.
pub fn validate(a: &RunArgs) -> Result<(), BoxError> {
    if a.write_baseline && !a.common.only.is_empty() {
        return Err("--write-baseline records every scenario; drop --only".into());
    }
    if a.write_baseline && a.common.diagnostics() {
        return Err(
            "--write-baseline records the product as shipped and configured as \
                    documented; drop --pg-set/--table-set/--pool-ping/--app-pool-ping"
                .into(),
        );
    }
    Ok(())
}

/// `run`, with `alongside` in the same sitting.
pub async fn run(a: &RunArgs, alongside: &mut impl Alongside) -> Result<ExitCode, BoxError> {
    let selected = select(&a.common.only, false)?;
    validate(a)?;
    let mut session = Session::open(&a.common, &a.common.pg_set).await?;
    let results = measure(
        &mut session,
        &selected,
        a.repeat,
        a.common.waldump,
        alongside,
    )
    .await?;
    summary(&results);
    alongside.after_all(&mut session, &results).await?;
    if let Some(path) = &a.json {
        let mut text = String::new();
        for m in &results {
            text.push_str(&serde_json::to_string(m)?);
            text.push('\n');
        }
        std::fs::write(path, text)?;
    }
    if a.write_baseline {
        Baseline::new(session.machine.clone(), &results).save(&a.common.baseline)?;
        println!("baseline written to {}", shown(&a.common.baseline));
    }
    Ok(ExitCode::SUCCESS)
}

/// `check`: exits 1 on a regression, naming the scenario, metric, baseline and current value.
pub async fn check(a: &CheckArgs) -> Result<ExitCode, BoxError> {
    let selected = select(&a.common.only, true)?;
    let baseline = Baseline::load(&a.common.baseline)?;
    let mut session = Session::open(&a.common, &a.common.pg_set).await?;
    // Statement and WAL counts may differ between majors: they are compared on the one
    // they were recorded on (`run` measures any).
    let (recorded, here) = (
        baseline.machine.postgres_major(),
        session.machine.postgres_major(),
    );
    if recorded != here {
        return Err(format!(
            "the baseline was recorded on {} and this server is {}: check compares counts on \
             the PostgreSQL major they were recorded on (unset PG_BIN, or --dsn a server of \
             that major); `run` measures any version",
            baseline.machine.postgres, session.machine.postgres
        )
        .into());
    }
    let results = measure(&mut session, &selected, 1, a.common.waldump, &mut ()).await?;
    summary(&results);
    println!(
        "check against {} (recorded {})",
        shown(&a.common.baseline),
        baseline.machine.date
    );
    let regressions = report::compare(&baseline, &results);
    if regressions.is_empty() {
        println!("check: ok ({} scenarios)", results.len());
        return Ok(ExitCode::SUCCESS);
    }
    for r in &regressions {
        println!(
            "REGRESSION {}: {}: baseline {}, current {} ({})",
            r.scenario, r.metric, r.baseline, r.current, r.why
        );
    }
    println!("check: {} regression(s)", regressions.len());
    Ok(ExitCode::FAILURE)
}

/// Runs each of `selected` `repeat` times and returns each one's median run, printing
/// every scenario's block as it finishes.
pub async fn measure(
    session: &mut Session,
    selected: &[Scenario],
    repeat: usize,
    waldump: bool,
    alongside: &mut impl Alongside,
) -> Result<Vec<Measurement>, BoxError> {
    let repeat = repeat.max(1);
    let mut results = Vec::new();
    for sc in selected {
        // Ours and what runs alongside alternate, so a burst of load elsewhere on the
        // machine hits both sides alike; each side reports its median run.
        let mut runs = Vec::new();
        for r in 0..repeat {
            let out = scenarios::run(&mut session.env, sc).await?;
            if repeat > 1 {
                eprintln!("  {} run {}: {}", sc.name, r + 1, headline(&out.m));
            }
            if waldump {
                if let Some(c) = &session.cluster {
                    println!(
                        "{} run {}: {}",
                        sc.name,
                        r + 1,
                        c.waldump(&out.lsn.0, &out.lsn.1)?
                    );
                }
            }
            runs.push((out.m, out.statements));
            alongside.after_run(session, sc, r).await?;
        }
        for (m, _) in &runs[1..] {
            let first = &runs[0].0;
            let differ = report::gated_counts_differ(sc, first, m);
            if !differ.is_empty() {
                println!(
                    "  note: {} gated counts differ between repeats (they must not): {}",
                    sc.name,
                    differ.join(", ")
                );
            }
        }
        runs.sort_by(|a, b| rank(&a.0).total_cmp(&rank(&b.0)));
        let (m, statements) = runs.swap_remove(runs.len() / 2);
        report::print_block(&m, &statements, session.env.verbose);
        results.push(m);
        alongside.after_scenario(sc);
    }
    Ok(results)
}

/// The summary table and the consumers against the per-commit limit.
fn summary(results: &[Measurement]) {
    println!();
    println!("{}", report::summary_table(results));
    if let Some(line) = report::against_commit_limit(results) {
        println!("{line}\n");
    }
}

/// What a run is ranked by when picking the median: throughput, or lateness p99.
fn rank(m: &Measurement) -> f64 {
    m.lateness_ms.map_or(m.msgs_per_second, |l| l.p99)
}

fn headline(m: &Measurement) -> String {
    match m.lateness_ms {
        Some(l) => format!(
            "lateness p50 {:.1} p99 {:.1} max {:.1} ms",
            l.p50, l.p99, l.max
        ),
        None => match m.client_cpu_seconds {
            Some(cpu) => format!(
                "{:.0} msg/s, client CPU {:.0} µs/msg",
                m.msgs_per_second,
                cpu * 1e6 / m.messages as f64
            ),
            None => format!("{:.0} msg/s", m.msgs_per_second),
        },
    }
}

/// The scenarios to run: `only`, or every scenario (with a gated figure, when `checking`).
pub fn select(only: &[String], checking: bool) -> Result<Vec<Scenario>, BoxError> {
    if only.is_empty() {
        return Ok(scenarios::ALL
            .iter()
            .filter(|s| !checking || s.checked())
            .copied()
            .collect());
    }
    only.iter()
        .map(|n| {
            scenarios::find(n).copied().ok_or_else(|| {
                let names: Vec<&str> = scenarios::ALL.iter().map(|s| s.name).collect();
                format!("unknown scenario `{n}`; known: {}", names.join(", ")).into()
            })
        })
        .collect()
}

fn shown(p: &Path) -> String {
    std::fs::canonicalize(p)
        .unwrap_or_else(|_| p.to_owned())
        .display()
        .to_string()
}
