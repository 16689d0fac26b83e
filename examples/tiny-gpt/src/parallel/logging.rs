//! The logger and panic hook, installed before the collective's: warnings on stderr, and a panic
//! of the collective's network tasks reported as one warning.

use tracing_subscriber::EnvFilter;

/// Logs warnings and errors on stderr (`RUST_LOG` shows more), and reports a panic of the
/// collective's network tasks as one warning.
///
/// Installed before anything else: the collective's network layer otherwise installs its own
/// logger when it starts, at INFO on stdout, one line for every tensor it sends. Its tasks (the
/// only tokio tasks of this program) panic when a connection to another node breaks; the replica
/// waiting on them then fails with an error naming the node, so their backtraces are noise.
pub fn quiet_logging() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    // Fails only if a logger is already installed, which then stays.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if std::thread::current().name() == Some("tokio-rt-worker") {
            let message = panic_message(info.payload());
            let location = info
                .location()
                .map(|l| format!(" at {l}"))
                .unwrap_or_default();
            tracing::warn!("the collective's network task failed{location}: {message}");
        } else {
            default_hook(info);
        }
    }));
}

/// A panic's message, from its payload.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}
