//! The watchdog's clock: the replicas report each step they finish, and the watchdog asks how
//! long ago the last one was (the collective never gives up on a peer that died).

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Steps finished, as the replicas report them, for the watchdog.
#[derive(Debug)]
pub struct Heartbeat {
    step: AtomicUsize,
    at: Mutex<Instant>,
}

impl Heartbeat {
    /// Nothing finished yet; the clock starts now.
    pub fn new() -> Self {
        Self {
            step: AtomicUsize::new(0),
            at: Mutex::new(Instant::now()),
        }
    }

    /// A replica finished `step`.
    pub fn beat(&self, step: usize) {
        self.step.fetch_max(step, Ordering::Relaxed);
        *self.at.lock().expect("heartbeat lock") = Instant::now();
    }

    /// The last step finished, and how long ago.
    pub fn last(&self) -> (usize, Duration) {
        let at = *self.at.lock().expect("heartbeat lock");
        (self.step.load(Ordering::Relaxed), at.elapsed())
    }
}
