//! `outbox ui`: the dashboard of `outbox-ui`, served until interrupted (Ctrl-C or SIGTERM
//! ends it after the requests under way).

use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::IntoResponse;
use axum::Router;
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
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| Failure::failed(format!("cannot listen on {}: {e}", args.listen)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Failure::failed(format!("cannot read the bound address: {e}")))?;
    let mut router = dashboard.router();
    if let Some((user, password)) = &args.basic_auth {
        router = outbox_ui::basic_auth(router, user, password);
    } else if addr.ip().is_loopback() {
        router = loopback_names_only(router, addr.port());
    }
    if !addr.ip().is_loopback() && args.basic_auth.is_none() {
        let what = if args.read_only {
            "read every payload, header and error of the queues"
        } else {
            "act on the queues"
        };
        eprintln!(
            "warning: the dashboard listens on {addr}, beyond this machine, without \
             authentication: anyone who reaches it can {what} (use --basic-auth and TLS in \
             front)"
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

/// A loopback dashboard without basic auth answers only requests addressed to a loopback
/// name (`Host` 127.0.0.1, localhost or [::1] with its port). DNS rebinding: a page of
/// another site, whose name its owner points at 127.0.0.1, reaches the dashboard from the
/// operator's browser with that name as `Host`, and the dashboard's `Origin` check (Origin
/// against Host) would let its forms through. Answered `421 Misdirected Request`.
fn loopback_names_only(router: Router, port: u16) -> Router {
    let mut allowed: Vec<String> = ["127.0.0.1", "localhost", "[::1]"]
        .iter()
        .map(|h| format!("{h}:{port}"))
        .collect();
    if port == 80 {
        allowed.extend(["127.0.0.1", "localhost", "[::1]"].map(String::from));
    }
    router.layer(axum::middleware::from_fn(
        move |request: Request, next: Next| {
            let ok = request
                .headers()
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .is_some_and(|h| allowed.iter().any(|a| a.eq_ignore_ascii_case(h)));
            async move {
                if ok {
                    next.run(request).await
                } else {
                    (
                        StatusCode::MISDIRECTED_REQUEST,
                        "this dashboard answers requests to 127.0.0.1, localhost or [::1] only \
                         (its Host header names another host); serve it under another name with \
                         --basic-auth\n",
                    )
                        .into_response()
                }
            }
        },
    ))
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
