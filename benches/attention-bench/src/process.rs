//! How the benchmark binaries start: one thread count for every pool the backends use (so that
//! "1 thread" is one thread), the backend `--backend` names, one `error:` line and exit code 2
//! when they fail.

use std::fmt::Display;
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitCode};

use attention_backends::{BackendName, FloatType, OnBackend, dispatch_in};

/// Runs `code` on `backend`, every pool `threads` wide when given: a benchmark binary's `main`.
pub fn run_on<C, E>(threads: Option<u16>, backend: BackendName, code: C) -> ExitCode
where
    C: OnBackend<Output = Result<(), E>>,
    E: Display,
{
    run_on_in(threads, backend, FloatType::F32, code)
}

/// [`run_on`] computing in `float`.
pub fn run_on_in<C, E>(
    threads: Option<u16>,
    backend: BackendName,
    float: FloatType,
    code: C,
) -> ExitCode
where
    C: OnBackend<Output = Result<(), E>>,
    E: Display,
{
    if let Some(threads) = threads
        && let Err(error) = ensure_threads(threads)
    {
        eprintln!("error: could not run again with {threads} threads: {error}");
        return ExitCode::from(2);
    }
    let error = match dispatch_in(backend, float, code) {
        Ok(Ok(())) => return ExitCode::SUCCESS,
        Ok(Err(error)) => error.to_string(),
        Err(cannot) => cannot.to_string(),
    };
    eprintln!("error: {error}");
    ExitCode::from(2)
}

/// The environment variables that size the thread pools our backends use: rayon's (our kernel,
/// burn-flex and its `gemm`, burn-ndarray's own loops) and matrixmultiply's (burn-ndarray's
/// matmul).
pub const THREAD_POOL_VARS: [&str; 2] = ["RAYON_NUM_THREADS", "MATMUL_NUM_THREADS"];

/// Makes every pool of this process `threads` wide: returns at once when the environment already
/// says so, otherwise runs this program again (same arguments) with it set and never returns
/// unless that fails, with the error.
///
/// Each pool reads its variable once, when it starts; setting them in this process would race
/// with those reads (and is `unsafe` in Rust 2024), hence the new process.
fn ensure_threads(threads: u16) -> Result<(), std::io::Error> {
    let wanted = threads.to_string();
    if THREAD_POOL_VARS
        .iter()
        .all(|var| std::env::var(var).ok().as_deref() == Some(&wanted))
    {
        return Ok(());
    }
    let mut again = Command::new(std::env::current_exe()?);
    again.args(std::env::args_os().skip(1));
    for var in THREAD_POOL_VARS {
        again.env(var, &wanted);
    }
    Err(again.exec())
}

/// The median of `times` (sorted in place); NaN when empty.
pub fn median(times: &mut [f64]) -> f64 {
    times.sort_by(f64::total_cmp);
    let n = times.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => times[n / 2],
        _ => (times[n / 2 - 1] + times[n / 2]) / 2.0,
    }
}
