//! A TCP kill switch: a loopback forwarder in front of one upstream address that can cut
//! every connection it carries at once and refuse new ones until restored — a network path
//! failing and coming back, for the drills (the cells drill's database outage, the
//! replication cut of the warm-region failover drill).
//!
//! A trip resets both sides of every live connection (zero linger, as a dead path ends them
//! for the peers' next read or write) and, while tripped, every new connection is accepted
//! and reset at once. The switch forwards until [`KillSwitch::stop`] (or the guard of
//! [`KillSwitch::stop_guard`]) ends its listener and every connection.

use anyhow::Context;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use tokio_util::sync::{CancellationToken, DropGuard};

/// A TCP forwarder that can cut every connection it carries and refuse new ones until
/// restored. Shared as `Arc<KillSwitch>`; its tasks run on the runtime that started it.
#[derive(Debug)]
pub struct KillSwitch {
    addr: SocketAddr,
    upstream: SocketAddr,
    state: Mutex<SwitchState>,
    /// Connections cut by trips.
    cut: AtomicU64,
    /// Connections closed at once while tripped.
    refused: AtomicU64,
    /// Stops the listener and every connection.
    stop: CancellationToken,
}

#[derive(Debug)]
struct SwitchState {
    tripped: bool,
    /// Cancelled by the next trip: every connection forwarded since the last one holds it.
    generation: CancellationToken,
    live: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl KillSwitch {
    /// Listens on a free loopback port (`127.0.0.1:0`) and forwards every connection to
    /// `upstream`. Errors when no port can be bound.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Arc<Self>> {
        let listener =
            tokio::net::TcpListener::bind("127.0.0.1:0").await.context("binding the kill switch")?;
        let switch = Arc::new(Self {
            addr: listener.local_addr()?,
            upstream,
            state: Mutex::new(SwitchState { tripped: false, generation: CancellationToken::new(), live: 0 }),
            cut: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            stop: CancellationToken::new(),
        });
        tokio::spawn(switch.clone().accept(listener));
        Ok(switch)
    }

    async fn accept(self: Arc<Self>, listener: tokio::net::TcpListener) {
        loop {
            let mut client = tokio::select! {
                _ = self.stop.cancelled() => return,
                a = listener.accept() => match a {
                    Ok((c, _)) => c,
                    Err(_) => continue,
                },
            };
            let generation = {
                let mut s = lock(&self.state);
                if s.tripped {
                    None
                } else {
                    s.live += 1;
                    Some(s.generation.clone())
                }
            };
            let Some(generation) = generation else {
                self.refused.fetch_add(1, Ordering::Relaxed);
                let _ = client.set_zero_linger();
                drop(client);
                continue;
            };
            let switch = self.clone();
            tokio::spawn(async move {
                let _ = client.set_nodelay(true);
                let forwarded = async {
                    let mut server = tokio::net::TcpStream::connect(switch.upstream).await?;
                    let _ = server.set_nodelay(true);
                    let copied = tokio::select! {
                        // A trip wins over bytes ready to forward.
                        biased;
                        _ = generation.cancelled() => None,
                        r = tokio::io::copy_bidirectional(&mut client, &mut server) => Some(r),
                    };
                    if copied.is_none() {
                        // Cut: reset both sides, as a dead network path would end them.
                        let _ = server.set_zero_linger();
                        let _ = client.set_zero_linger();
                        switch.cut.fetch_add(1, Ordering::Relaxed);
                    }
                    std::io::Result::Ok(())
                };
                tokio::select! {
                    _ = switch.stop.cancelled() => {}
                    _ = forwarded => {}
                }
                lock(&switch.state).live -= 1;
            });
        }
    }

    /// The listening address clients connect to instead of the upstream.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address every connection is forwarded to.
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// Cuts every live connection and refuses new ones; returns how many were live.
    pub fn trip(&self) -> u64 {
        let mut s = lock(&self.state);
        s.tripped = true;
        s.generation.cancel();
        s.generation = CancellationToken::new();
        s.live
    }

    /// Forwards new connections again (the ones cut stay cut).
    pub fn restore(&self) {
        lock(&self.state).tripped = false;
    }

    /// Whether the switch is tripped (refusing new connections).
    pub fn is_tripped(&self) -> bool {
        lock(&self.state).tripped
    }

    /// Connections cut by trips so far.
    pub fn cut_count(&self) -> u64 {
        self.cut.load(Ordering::Relaxed)
    }

    /// Connections refused (accepted and reset at once) while tripped so far.
    pub fn refused_count(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Stops the listener and ends every connection (without a reset); for good.
    pub fn stop(&self) {
        self.stop.cancel();
    }

    /// A guard that [stops](Self::stop) the switch when dropped.
    pub fn stop_guard(&self) -> DropGuard {
        self.stop.clone().drop_guard()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_kill_switch_cuts_refuses_and_forwards_again() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let echo = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let upstream = echo.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = echo.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        let switch = KillSwitch::start(upstream).await.unwrap();
        let roundtrip = |mut s: tokio::net::TcpStream| async move {
            s.write_all(b"ping").await?;
            let mut buf = [0u8; 4];
            s.read_exact(&mut buf).await?;
            std::io::Result::Ok((s, buf))
        };
        let (mut live, buf) =
            roundtrip(tokio::net::TcpStream::connect(switch.addr()).await.unwrap()).await.unwrap();
        assert_eq!(&buf, b"ping");
        assert_eq!(switch.trip(), 1);
        assert!(switch.is_tripped());
        let mut buf = [0u8; 1];
        assert!(matches!(live.read(&mut buf).await, Ok(0) | Err(_)), "the live connection is cut");
        let refused = roundtrip(tokio::net::TcpStream::connect(switch.addr()).await.unwrap()).await;
        assert!(refused.is_err(), "a new connection is closed at once");
        switch.restore();
        let (_, buf) = roundtrip(tokio::net::TcpStream::connect(switch.addr()).await.unwrap()).await.unwrap();
        assert_eq!(&buf, b"ping");
        assert_eq!(switch.cut_count(), 1);
        assert_eq!(switch.refused_count(), 1);
        switch.stop();
    }
}
