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
    // Refuse tables that are not there (with the migrate advice, as every other command),
    // rather than serve pages that each fail with the database's error.
    migrated(&outbox, &pool).await?;
    let dashboard = outbox_ui::Dashboard::new(outbox, pool)
        .and_then(|d| d.lease_ttl(args.lease_ttl))
        .map_err(|e| Failure::usage(e.to_string()))?
        .read_only(args.read_only);
    if args.throughput_counter {
        dashboard
            .install_throughput_counter()
            .await
            .map_err(|e| Failure::failed(e.to_string()))?;
        eprintln!("outbox ui: the throughput counter is installed (remove it with --remove-throughput-counter)");
    } else if args.remove_throughput_counter {
        dashboard
            .remove_throughput_counter()
            .await
            .map_err(|e| Failure::failed(e.to_string()))?;
        eprintln!("outbox ui: the throughput counter is removed");
    }
    let listen = resolve(&args.listen).await?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| Failure::failed(format!("cannot listen on {}: {e}", args.listen)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Failure::failed(format!("cannot read the bound address: {e}")))?;
    let mut router = dashboard.router();
    // The whole 127.0.0.0/8 and ::1 are loopback, and so is an IPv4-mapped IPv6 address
    // of them (`[::ffff:127.0.0.1]`, which `Ipv6Addr::is_loopback` alone calls not).
    let loopback = addr.ip().to_canonical().is_loopback();
    if let Some((user, password)) = &args.basic_auth {
        router = outbox_ui::basic_auth(router, user, password);
    } else if loopback {
        router = outbox_ui::security_headers(loopback_names_only(router, addr));
    }
    if !loopback && args.basic_auth.is_none() {
        let what = if args.read_only {
            "read every payload, header and error of the queues"
        } else {
            "act on the queues"
        };
        eprintln!(
            "warning: the dashboard listens on {addr}, beyond this machine, without \
             authentication: anyone who reaches it can {what}; and any web page your own \
             browser opens can drive it too, under a name its owner points at this address \
             (DNS rebinding). Use --basic-auth (and TLS in front)."
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

/// Each table the dashboard reads exists: the queue table, the paused-queues table, and
/// the dead-letter table when it is on; else the library's `NotMigrated`, which the command
/// explains with its `outbox … migrate` advice.
async fn migrated(outbox: &Outbox, pool: &PgPool) -> Result<(), Failure> {
    // The library's own reads, so a missing table is its `NotMigrated` (or
    // `UpgradeRequired`); each reads at most one row by an index.
    let mut conn = pool.acquire().await?;
    outbox
        .pending(&mut conn, "outbox-ui-startup-check", 1)
        .await?;
    outbox.paused_queues(&mut conn).await?;
    if outbox.dead_letter_enabled() {
        let none = outbox::dlq::DeadLetterFilter::new().queue("outbox-ui-startup-check");
        outbox.dead_letters(&mut conn, &none, None, 1).await?;
    }
    Ok(())
}

/// `--listen`: an address and port, or a host name and port (`localhost:8080`), resolved;
/// the first address is taken.
async fn resolve(listen: &str) -> Result<std::net::SocketAddr, Failure> {
    if let Ok(addr) = listen.parse() {
        return Ok(addr);
    }
    let bad = |why: String| {
        Failure::usage(format!(
            "bad --listen {listen:?}: {why}; write HOST:PORT, e.g. 127.0.0.1:8080, [::1]:8080 or localhost:8080"
        ))
    };
    let Some((host, port)) = listen.rsplit_once(':') else {
        if listen.parse::<u16>().is_ok() {
            return Err(bad(format!(
                "no host (a port alone): write 127.0.0.1:{listen} for this machine only"
            )));
        }
        return Err(bad("no port".to_owned()));
    };
    if host.is_empty() {
        return Err(bad("no host".to_owned()));
    }
    if port.parse::<u16>().is_err() {
        return Err(bad(format!("{port:?} is not a port (0 to 65535)")));
    }
    let mut addrs = tokio::net::lookup_host(listen)
        .await
        .map_err(|e| bad(format!("cannot resolve {host:?}: {e}")))?;
    addrs
        .next()
        .ok_or_else(|| bad(format!("{host:?} resolves to no address")))
}

/// A loopback dashboard without basic auth answers only requests addressed to a loopback
/// name (`Host` 127.0.0.1, localhost, [::1] or the address it listens on, with its port). DNS rebinding: a page of
/// another site, whose name its owner points at 127.0.0.1, reaches the dashboard from the
/// operator's browser with that name as `Host`, and the dashboard's `Origin` check (Origin
/// against Host) would let its forms through. Answered `421 Misdirected Request`.
fn loopback_names_only(router: Router, addr: std::net::SocketAddr) -> Router {
    let port = addr.port();
    // The address as printed (`127.0.0.2`, `[::ffff:127.0.0.1]`) besides the usual names.
    let own = match addr.ip() {
        std::net::IpAddr::V4(ip) => ip.to_string(),
        std::net::IpAddr::V6(ip) => format!("[{ip}]"),
    };
    let names = ["127.0.0.1", "localhost", "[::1]", own.as_str()];
    let mut allowed: Vec<String> = names.iter().map(|h| format!("{h}:{port}")).collect();
    if port == 80 {
        allowed.extend(names.map(String::from));
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
                        "this dashboard answers requests to 127.0.0.1, localhost, [::1] or the \
                         address it listens on only (its Host header names another host); serve \
                         it under another name with --basic-auth\n",
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
