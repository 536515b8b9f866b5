//! A TCP proxy in front of Postgres (or a broker, [`Proxy::start_to`]) that a test can cut
//! and restore, to play "the server is down" for one test's connections without touching
//! the server the other tests use. Cut, it closes every forwarded connection and refuses
//! new ones (its port is closed).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::database_url;

/// The proxy: forwards `127.0.0.1:<port>` to the server of `DATABASE_URL`.
pub struct Proxy {
    addr: SocketAddr,
    upstream: String,
    /// `true` while cut: forwarding tasks end, the listener is gone.
    cut: watch::Sender<bool>,
    accept: Mutex<Option<JoinHandle<()>>>,
    /// How long each new connection waits before the proxy connects it upstream.
    connect_delay: std::time::Duration,
}

impl Proxy {
    /// Starts a proxy on a free local port.
    pub async fn start() -> Arc<Proxy> {
        let url: url_parts::Url = url_parts::Url::parse(&database_url());
        Proxy::start_to(&format!("{}:{}", url.host, url.port)).await
    }

    /// Starts a proxy on a free local port to `upstream` (`host:port`).
    pub async fn start_to(upstream: &str) -> Arc<Proxy> {
        Proxy::start_delayed_to(upstream, std::time::Duration::ZERO).await
    }

    /// As [`Proxy::start_to`], holding each new connection for `delay` before connecting it
    /// upstream: a slow connect (a remote broker, a TLS handshake), while the bytes of an
    /// open connection pass at once.
    pub async fn start_delayed_to(upstream: &str, delay: std::time::Duration) -> Arc<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind a port");
        let addr = listener.local_addr().expect("local address");
        let (cut, _) = watch::channel(false);
        let proxy = Arc::new(Proxy {
            addr,
            upstream: upstream.to_owned(),
            cut,
            accept: Mutex::new(None),
            connect_delay: delay,
        });
        proxy.serve(listener);
        proxy
    }

    /// The proxy's `host:port`.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `DATABASE_URL` with the proxy's address in place of the server's.
    pub fn url(&self) -> String {
        let url = url_parts::Url::parse(&database_url());
        format!(
            "{}{}:{}{}",
            url.before_host,
            self.addr.ip(),
            self.addr.port(),
            url.after_port
        )
    }

    fn serve(self: &Arc<Self>, listener: TcpListener) {
        let me = self.clone();
        let task = tokio::spawn(async move {
            let mut cut = me.cut.subscribe();
            loop {
                let accepted = tokio::select! {
                    a = listener.accept() => a,
                    _ = cut.changed() => if *cut.borrow() { return } else { continue },
                };
                let Ok((client, _)) = accepted else { continue };
                let upstream = me.upstream.clone();
                let mut cut = me.cut.subscribe();
                let delay = me.connect_delay;
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    let Ok(mut server) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let mut client = client;
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut.wait_for(|c| *c) => {}
                    }
                });
            }
        });
        *self.accept.lock().unwrap() = Some(task);
    }

    /// The database "goes down": every connection through the proxy is closed and new ones
    /// are refused until [`Proxy::restore`].
    pub async fn cut(&self) {
        self.cut.send_replace(true);
        let task = self.accept.lock().unwrap().take();
        if let Some(task) = task {
            task.abort();
            let _ = task.await;
        }
    }

    /// The database "comes back" on the same port.
    pub async fn restore(self: &Arc<Self>) {
        let listener = TcpListener::bind(self.addr).await.expect("rebind the port");
        self.cut.send_replace(false);
        self.serve(listener);
    }
}

/// Just enough URL handling to swap the host and port of a `postgres://` URL.
mod url_parts {
    pub(super) struct Url {
        pub before_host: String,
        pub host: String,
        pub port: u16,
        pub after_port: String,
    }

    impl Url {
        pub(super) fn parse(url: &str) -> Url {
            let scheme_end = url.find("://").map_or(0, |i| i + 3);
            let rest = &url[scheme_end..];
            let at = rest.find('@').map_or(0, |i| i + 1);
            let authority_end = rest[at..].find(['/', '?']).map_or(rest.len(), |i| at + i);
            let hostport = &rest[at..authority_end];
            let (host, port) = match hostport.rsplit_once(':') {
                Some((h, p)) => (h.to_owned(), p.parse().unwrap_or(5432)),
                None => (hostport.to_owned(), 5432),
            };
            let host = if host.is_empty() {
                "127.0.0.1".to_owned()
            } else {
                host
            };
            Url {
                before_host: url[..scheme_end + at].to_owned(),
                host,
                port,
                after_port: rest[authority_end..].to_owned(),
            }
        }
    }
}
