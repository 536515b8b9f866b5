//! `run --scale` and `run --soak`: the growth curves and the soak (SPEC §12 v2), run
//! instead of the scenarios. They take minutes, their figures are timings, and they are
//! never part of `check`. Both print tables, write JSON lines (`--json FILE`: the curves'
//! points, the soak's start line and samples, each with a `kind`) and draw SVG plots into
//! `--plots DIR`, which `outbox-lab plot` can redraw from the JSON lines.

use std::path::Path;

use outbox_bench::session::{Common, Session};
use outbox_bench::BoxError;

use crate::plot::{self, PlotDir};
use crate::scale::{self, ScaleArgs};
use crate::soak::{self, SoakArgs};

pub async fn run(
    common: &Common,
    scale_args: &ScaleArgs,
    soak_args: &SoakArgs,
    plots: &PlotDir,
    json: Option<&Path>,
) -> Result<std::process::ExitCode, BoxError> {
    // The soak needs autovacuum whatever the mirrored server says (see soak.rs).
    let mut pg_set = common.pg_set.clone();
    if soak_args.soak.is_some() {
        pg_set.push(format!("autovacuum={}", soak_args.autovacuum));
    }
    let mut session = Session::open(common, &pg_set).await?;
    let env = &mut session.env;
    let mut lines = Vec::new();
    if scale_args.scale {
        let points = scale::run(env, scale_args).await?;
        println!("\n{}", scale::tables(&points));
        for p in &points {
            lines.push(serde_json::to_string(p)?);
        }
        plot::scale(&plots.plots, &points)?;
    }
    if let Some(minutes) = soak_args.soak {
        let (start, samples) = soak::run(env, soak_args, minutes).await?;
        lines.push(serde_json::to_string(&start)?);
        for s in &samples {
            lines.push(serde_json::to_string(s)?);
        }
        if !samples.is_empty() {
            plot::soak(&plots.plots, Some(&start), &samples)?;
        }
    }
    if let Some(path) = json {
        let mut text = lines.join("\n");
        text.push('\n');
        std::fs::write(path, text)?;
    }
    Ok(std::process::ExitCode::SUCCESS)
}
