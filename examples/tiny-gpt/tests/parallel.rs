//! `tiny-gpt train` with data-parallel replicas on Burn's collective: replicas in threads and in
//! processes reach the parameters one replica reaches on the whole batch (on packed documents
//! too); a node that dies or stalls ends the others with an error naming it; settings that cannot
//! run are refused up front.

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_tiny-gpt");

/// A tiny model.
const SMALL: [&str; 10] = [
    "--context",
    "8",
    "--d-model",
    "16",
    "--heads",
    "2",
    "--layers",
    "1",
    "--seed",
    "3",
];
/// SGD with steps large enough that half a batch goes elsewhere in a few of them (and diverges
/// in a few dozen).
const LARGE_SGD_STEPS: [&str; 4] = ["--optimizer", "sgd", "--learning-rate", "20"];
/// A short run, with time for every process to start.
const SHORT: [&str; 4] = ["--steps", "3", "--peer-timeout", "30"];

/// `args` with [`LARGE_SGD_STEPS`].
fn sgd<'a>(args: &[&'a str]) -> Vec<&'a str> {
    [&LARGE_SGD_STEPS[..], args].concat()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tiny-gpt-parallel-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn train(out: &Path, extra: &[&str]) -> Command {
    let mut command = Command::new(BIN);
    command
        .args(["train", "--out", out.to_str().unwrap()])
        .args(SMALL)
        .args(extra);
    if !extra.contains(&"--steps") {
        command.args(SHORT);
    }
    command
}

fn succeeded(output: &Output) {
    assert!(
        output.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

fn weights(checkpoint: &Path) -> Vec<(String, Vec<f32>)> {
    let tensors = tensor_files::read(&checkpoint.join("model.safetensors")).unwrap();
    let mut named: Vec<(String, Vec<f32>)> = tensors
        .iter()
        .map(|(name, raw)| (name.clone(), raw.to_f32().expect("f32 weights")))
        .collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

/// The largest `max |a − b| / max(max |b|, 1e-6)` over the tensors.
fn relative_difference(a: &Path, b: &Path) -> f32 {
    let (a, b) = (weights(a), weights(b));
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|((name_a, a), (name_b, b))| {
            assert_eq!(name_a, name_b);
            let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
            let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            diff / scale
        })
        .fold(0f32, f32::max)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits for `child` at most `limit`, killing it after.
fn wait(mut child: Child, limit: Duration) -> (Output, Duration) {
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > limit {
            child.kill().unwrap();
            let output = child.wait_with_output().unwrap();
            panic!(
                "still running after {limit:?}; stderr: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let elapsed = started.elapsed();
    (child.wait_with_output().unwrap(), elapsed)
}

/// The two ranks of a run across processes on this machine.
fn two_nodes(out: &Path, extra: &[&str]) -> [Child; 2] {
    let orchestrator = format!("127.0.0.1:{}", free_port());
    [0, 1].map(|rank| {
        let data = format!("127.0.0.1:{}", free_port());
        let rank = rank.to_string();
        let mut command = train(out, extra);
        command
            .args(["--nodes", "2", "--node-rank", &rank])
            .args(["--orchestrator", &orchestrator, "--data-address", &data])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command.spawn().unwrap()
    })
}

#[test]
fn replicas_reach_the_parameters_of_one_replica_on_the_whole_batch() {
    let dir = scratch("equivalence");
    let one = dir.join("one");
    let halves = dir.join("half");
    let two = dir.join("two");
    succeeded(&train(&one, &sgd(&["--batch", "4"])).output().unwrap());
    // The same run on half of each batch: what a replica reaches if nothing is averaged.
    succeeded(&train(&halves, &sgd(&["--batch", "2"])).output().unwrap());
    succeeded(
        &train(&two, &sgd(&["--batch", "4", "--peers", "2"]))
            .output()
            .unwrap(),
    );
    let alone = relative_difference(&halves, &one);
    assert!(alone > 1e-3, "half a batch alone differs by only {alone}");
    let threads = relative_difference(&two, &one);
    assert!(threads <= 1e-5, "2 replicas in threads: {threads}");
    eprintln!(
        "relative difference to one replica: 2 threads {threads:.1e} (half a batch alone: {alone:.1e})"
    );
}

/// With `--pack` each replica builds its rows' documents from the row indices it is dealt, and
/// divides its loss by the whole batch's label count: the replicas' mean is one replica's loss.
#[test]
fn packed_replicas_reach_the_parameters_of_one_replica_on_the_whole_batch() {
    let dir = scratch("packed");
    let one = dir.join("one");
    let two = dir.join("two");
    succeeded(
        &train(&one, &sgd(&["--batch", "4", "--pack"]))
            .output()
            .unwrap(),
    );
    succeeded(
        &train(&two, &sgd(&["--batch", "4", "--pack", "--peers", "2"]))
            .output()
            .unwrap(),
    );
    let threads = relative_difference(&two, &one);
    assert!(threads <= 1e-5, "2 replicas in threads, packed: {threads}");
}

#[test]
fn processes_reach_the_parameters_of_one_replica_on_the_whole_batch() {
    let dir = scratch("processes");
    let one = dir.join("one");
    let across = dir.join("across");
    succeeded(&train(&one, &sgd(&["--batch", "4"])).output().unwrap());
    for rank in two_nodes(&across, &sgd(&["--batch", "4"])) {
        let (output, _) = wait(rank, Duration::from_secs(120));
        succeeded(&output);
    }
    let processes = relative_difference(&across, &one);
    assert!(processes <= 1e-5, "2 processes: {processes}");
    eprintln!("relative difference to one replica: 2 processes {processes:.1e}");
}

/// Kills node `victim` of two mid-run: the other must end with an error naming it, within the
/// timeout, and write no checkpoint.
fn a_node_that_dies_ends_the_other_with_an_error_naming_it(victim: usize) {
    let dir = scratch(&format!("killed-{victim}"));
    let out = dir.join("ckpt");
    let timeout = 5;
    let mut ranks = two_nodes(
        &out,
        &[
            "--batch",
            "2",
            "--steps",
            "1000000",
            "--peer-timeout",
            &timeout.to_string(),
        ],
    )
    .map(Some);
    std::thread::sleep(Duration::from_secs(4));
    let mut killed = ranks[victim].take().unwrap();
    killed.kill().unwrap();
    let _ = killed.wait();
    let survivor = ranks[1 - victim].take().unwrap();
    let (output, elapsed) = wait(survivor, Duration::from_secs(timeout + 30));
    let mut stderr = String::new();
    output
        .stderr
        .as_slice()
        .read_to_string(&mut stderr)
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    // The collective's own network tasks may still log a warning after it.
    let errors: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("error: "))
        .collect();
    assert!(
        errors.len() == 1 && errors[0].contains(&format!("node rank {victim}")),
        "{stderr}"
    );
    assert!(elapsed < Duration::from_secs(timeout + 20), "{elapsed:?}");
    assert!(!out.join("model.safetensors").exists());
}

#[test]
fn a_node_that_never_joins_ends_rank_0_with_an_error_naming_it() {
    let dir = scratch("never-joins");
    let out = dir.join("ckpt");
    let orchestrator = format!("127.0.0.1:{}", free_port());
    let data = format!("127.0.0.1:{}", free_port());
    let rank0 = train(
        &out,
        &["--batch", "2", "--steps", "3", "--peer-timeout", "3"],
    )
    .args(["--nodes", "2", "--node-rank", "0"])
    .args(["--orchestrator", &orchestrator, "--data-address", &data])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let (output, elapsed) = wait(rank0, Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.trim_end().ends_with(
            "node rank 1 did not answer (it died or never joined); raise --peer-timeout if steps \
             are that slow"
        ),
        "{stderr}"
    );
    assert!(elapsed >= Duration::from_secs(3), "{elapsed:?}");
    assert!(!out.join("model.safetensors").exists());
}

#[test]
fn a_worker_node_that_dies_ends_rank_0_with_an_error_naming_it() {
    a_node_that_dies_ends_the_other_with_an_error_naming_it(1);
}

#[test]
fn rank_0_dying_ends_the_worker_with_an_error_naming_it() {
    a_node_that_dies_ends_the_other_with_an_error_naming_it(0);
}

fn refused(args: &[&str], needle: &str) {
    let dir = scratch("refused");
    let output = train(&dir.join("ckpt"), args).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(
        stderr.starts_with("error: ") && stderr.lines().count() == 1 && stderr.contains(needle),
        "{args:?}: {stderr} should say {needle:?}"
    );
}

#[test]
fn settings_that_cannot_run_are_refused_up_front() {
    refused(
        &["--batch", "3", "--peers", "2"],
        "--batch 3: must be divisible by the 2 replicas",
    );
    refused(
        &["--batch", "2", "--peers", "0"],
        "--peers 0: must be at least 1",
    );
    refused(
        &["--batch", "2", "--orchestrator", "127.0.0.1:1"],
        "--orchestrator: only with --nodes above 1",
    );
    refused(
        &["--batch", "2", "--nodes", "2", "--node-rank", "2"],
        "--node-rank 2: must be below --nodes 2",
    );
    refused(
        &[
            "--batch",
            "2",
            "--nodes",
            "2",
            "--data-address",
            "127.0.0.1:1",
        ],
        "--orchestrator: required with --nodes above 1",
    );
    let taken = TcpListener::bind("0.0.0.0:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let orchestrator = format!("127.0.0.1:{}", free_port());
    refused(
        &[
            "--batch",
            "2",
            "--nodes",
            "2",
            "--orchestrator",
            &orchestrator,
            "--data-address",
            &format!("127.0.0.1:{port}"),
        ],
        &format!("data service port {port} is in use"),
    );
    let output = Command::new(BIN)
        .args(["orchestrator", "--port", &port.to_string()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.starts_with(&format!("error: orchestrator port {port} is in use"))
            && stderr.lines().count() == 1,
        "{stderr}"
    );
}
