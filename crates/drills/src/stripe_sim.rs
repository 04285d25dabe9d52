//! `boxoffice-drills stripe-sim`: the Stripe simulator ([`boxoffice_stripe_sim`]) as a server
//! of its own, configured like the in-process one ([`boxoffice_harness::deploy::sim_config`]:
//! the configured webhook secret, the event types the API handles), for demos against a
//! `boxoffice serve` and for the chaos drill's simulator process. State lives in memory and
//! is lost when it stops (SIGTERM / ctrl-c).

use anyhow::Context;
use boxoffice::commands::wait_for_signal;
use boxoffice::config::Config;
use tokio_util::sync::CancellationToken;

/// Serves the simulator on `bind` until SIGTERM / ctrl-c, delivering signed webhooks to
/// `webhook_url` (none: events are dropped).
pub async fn serve(cfg: &Config, bind: &str, webhook_url: Option<String>) -> anyhow::Result<()> {
    let sim = boxoffice_stripe_sim::StripeSim::new(boxoffice_stripe_sim::SimConfig {
        webhook_url,
        ..boxoffice_harness::deploy::sim_config(cfg)
    });
    let listener = tokio::net::TcpListener::bind(bind).await.with_context(|| format!("binding {bind}"))?;
    tracing::info!(addr = %listener.local_addr()?, "stripe simulator listening");
    let shutdown = CancellationToken::new();
    let s2 = shutdown.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        s2.cancel();
    });
    sim.serve(listener, shutdown).await?;
    Ok(())
}
