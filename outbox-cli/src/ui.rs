//! `outbox ui`: the dashboard of `outbox-ui`, served until interrupted (Ctrl-C or SIGTERM
//! ends it after the requests under way).

use outbox::Outbox;
use sqlx::PgPool;

use crate::cli::UiArgs;
use crate::connect::Failure;
use crate::output;

pub async fn run(outbox: Outbox, pool: PgPool, args: UiArgs) -> Result<(), Failure> {
    let dashboard = outbox_ui::Dashboard::new(outbox, pool)
        .and_then(|d| d.lease_ttl(args.lease_ttl))
        .map_err(|e| Failure::usage(e.to_string()))?
        .read_only(args.read_only);
    let mut router = dashboard.router();
    if let Some((user, password)) = &args.basic_auth {
        router = outbox_ui::basic_auth(router, user, password);
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| Failure::failed(format!("cannot listen on {}: {e}", args.listen)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Failure::failed(format!("cannot read the bound address: {e}")))?;
    if !addr.ip().is_loopback() && args.basic_auth.is_none() {
        eprintln!(
            "warning: the dashboard listens on {addr}, beyond this machine, without \
             authentication: anyone who reaches it can act on the queues (use --basic-auth \
             and TLS in front, or --read-only)"
        );
    }
    output::line(format!(
        "outbox ui: http://{addr}/{}{}",
        if args.read_only { " (read-only)" } else { "" },
        if args.basic_auth.is_some() {
            " (basic auth)"
        } else {
            ""
        }
    ));
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown())
        .await
        .map_err(|e| Failure::failed(format!("the dashboard's server failed: {e}")))
}

async fn shutdown() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(t) => t,
                Err(_) => {
                    let _ = interrupt.await;
                    return;
                }
            };
        tokio::select! {
            _ = interrupt => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}
