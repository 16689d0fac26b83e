//! The GPU kernels as NVIDIA's compiler sees them, without a GPU: cubecl's CUDA compiler writes
//! each kernel's source (attention-core's `kernel-report` feature), `nvcc` compiles it for
//! `sm_90` (H100/H200) with `ptxas -v`, `cuobjdump -sass` disassembles it; one markdown row per
//! kernel: registers, local-memory (spill) bytes, shared memory, the cubes an SM holds, and the
//! instruction mix. After it, one row per tiling: the variant the kernel tests force on lavapipe
//! (where CI runs them) that stands for it, the same kernel, float type and cube at a tile
//! lavapipe holds, or that none is tested, or that lavapipe holds none, with the bytes it needs.
//!
//! ```text
//! python3 -m venv ~/cuda-venv && ~/cuda-venv/bin/pip install "nvidia-cuda-nvcc==13.0.*" \
//!     "nvidia-cuda-crt==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-cccl==13.0.*" \
//!     "nvidia-cuda-cuobjdump==13.0.*"
//! CUDA_HOME=$(echo ~/cuda-venv/lib/python3*/site-packages/nvidia/cu13) \
//!     cargo run --release -p kernel-report
//! ```
//!
//! A wgpu adapter (any: lavapipe does) defines the kernels; no CUDA driver is touched.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use attention_core::kernel_report::{KernelSource, cuda_sources};
use clap::Parser;

/// Compiles the GPU kernels for sm_90 and prints what ptxas and the disassembly say.
#[derive(Debug, Parser)]
struct Args {
    /// The CUDA toolkit's folder (its `bin/nvcc`, `bin/cuobjdump`); default `$CUDA_HOME`.
    #[arg(long)]
    cuda_home: Option<PathBuf>,
    /// Where the sources and cubins go.
    #[arg(long, default_value = "target/kernel-report")]
    out: PathBuf,
    /// Head widths to compile for.
    #[arg(long = "head-dim", default_values_t = [64, 128])]
    head_dims: Vec<usize>,
    /// Float types.
    #[arg(long = "dtype", default_values_t = ["f32".to_string(), "f16".to_string()])]
    dtypes: Vec<String>,
}

/// Shared memory per cube the tiling rule is given: a Vulkan adapter on NVIDIA's driver (48 KiB,
/// what `--backend wgpu` gets on the H200) and CUDA's opt-in maximum on sm_90 (227 KiB).
const BUDGETS: [(&str, usize); 2] = [("vulkan 48 KiB", 48 << 10), ("cuda 227 KiB", 227 << 10)];

/// sm_90's per-SM limits: registers, units, cubes, shared memory (bytes, with the 1 KiB each
/// cube reserves).
const SM_REGISTERS: u32 = 65536;
const SM_UNITS: u32 = 2048;
const SM_CUBES: u32 = 32;
const SM_SHARED: u32 = 228 << 10;

/// The SASS opcodes counted, by what they are.
const OPCODES: [&str; 10] = [
    "FFMA", "HFMA2", "LDS", "STS", "LDG", "STG", "LDL", "STL", "BAR", "MUFU",
];

fn main() -> ExitCode {
    let mut args = Args::parse();
    args.cuda_home = args
        .cuda_home
        .or_else(|| std::env::var_os("CUDA_HOME").map(PathBuf::from));
    if args.cuda_home.is_none() {
        eprintln!("error: no CUDA toolkit: pass --cuda-home or set CUDA_HOME (see --help)");
        return ExitCode::from(2);
    }
    if let Err(error) = std::fs::create_dir_all(&args.out) {
        eprintln!("error: {}: {error}", args.out.display());
        return ExitCode::from(2);
    }
    println!(
        "| budget | kernel | units | shared (B) | registers | stack (B) | spill st/ld (B) | cubes/SM (warps) | {} |",
        OPCODES.join(" | ")
    );
    println!("|{}", "---|".repeat(8 + OPCODES.len()));
    let mut failed = false;
    let mut stand_ins = Vec::new();
    for (budget, bytes) in BUDGETS {
        for dtype in &args.dtypes {
            for &head_dim in &args.head_dims {
                for kernel in cuda_sources(dtype, head_dim, bytes) {
                    match report(&args, &kernel) {
                        Ok(row) => println!("| {budget} | {} | {row}", kernel.name),
                        Err(error) => {
                            failed = true;
                            eprintln!("error: {}: {error}", kernel.name);
                        }
                    }
                    if let Some(stand_in) = &kernel.stand_in {
                        stand_ins.push(format!(
                            "| {budget} | {} | {} | {stand_in} |",
                            kernel.name, kernel.shared_memory
                        ));
                    }
                }
            }
        }
    }
    println!();
    println!("| budget | kernel | shared (B) | lavapipe stand-in |");
    println!("|---|---|---|---|");
    for row in stand_ins {
        println!("{row}");
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// One row past the kernel's name.
fn report(args: &Args, kernel: &KernelSource) -> Result<String, String> {
    let stem = args.out.join(kernel.name.replace(' ', "-"));
    let source = stem.with_extension("cu");
    let cubin = stem.with_extension("cubin");
    std::fs::write(&source, &kernel.source).map_err(|e| e.to_string())?;
    let cuda_home = args.cuda_home.as_ref().expect("checked in main");
    let ptxas = run(
        &cuda_home.join("bin/nvcc"),
        &[
            "-arch=sm_90",
            "-cubin",
            "-Xptxas",
            "-v",
            "-o",
            path(&cubin),
            path(&source),
        ],
    )?;
    let mut info = Ptxas::parse(&ptxas, &kernel.entry)?;
    // cubecl declares shared memory dynamically, which ptxas does not count.
    info.shared = info.shared.max(kernel.shared_memory as u32);
    let sass = run(&cuda_home.join("bin/cuobjdump"), &["-sass", path(&cubin)])?;
    let counts = opcode_counts(&sass);
    let warps = kernel.units.div_ceil(32);
    // Registers are given per warp in units of 256.
    let per_warp = (info.registers * 32).div_ceil(256) * 256;
    let cubes = [
        SM_REGISTERS / (per_warp * warps).max(1),
        SM_UNITS / kernel.units,
        SM_CUBES,
        SM_SHARED / (info.shared + 1024),
    ]
    .into_iter()
    .min()
    .unwrap_or(0);
    let mix: Vec<String> = OPCODES
        .iter()
        .map(|op| counts.get(*op).copied().unwrap_or(0).to_string())
        .collect();
    Ok(format!(
        "{} | {} | {} | {} | {}/{} | {} ({}) | {} |",
        kernel.units,
        info.shared,
        info.registers,
        info.stack,
        info.spill_stores,
        info.spill_loads,
        cubes,
        cubes * warps,
        mix.join(" | ")
    ))
}

fn path(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

/// `program args…`'s stdout and stderr, or why it failed.
fn run(program: &Path, args: &[&str]) -> Result<String, String> {
    let output = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{}: {e}", program.display()))?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        return Err(format!("{} failed:\n{text}", program.display()));
    }
    Ok(text)
}

/// What `ptxas -v` says of one entry point.
#[derive(Debug, Default)]
struct Ptxas {
    registers: u32,
    stack: u32,
    spill_stores: u32,
    spill_loads: u32,
    shared: u32,
}

impl Ptxas {
    /// From lines such as `ptxas info    : Compiling entry function 'x' for 'sm_90'`, `… 0 bytes
    /// stack frame, 0 bytes spill stores, 0 bytes spill loads`, `… Used 40 registers, used 1
    /// barriers, 38912 bytes smem, …`.
    fn parse(text: &str, entry: &str) -> Result<Self, String> {
        let mut lines = text
            .lines()
            .skip_while(|line| !(line.contains("entry function") && line.contains(entry)));
        lines
            .next()
            .ok_or_else(|| format!("ptxas said nothing of `{entry}`:\n{text}"))?;
        let mut info = Self::default();
        for line in lines.take(3) {
            let number_before = |word: &str| {
                let at = line.find(word)?;
                line[..at].split_whitespace().last()?.parse::<u32>().ok()
            };
            if let Some(n) = number_before("bytes stack frame") {
                info.stack = n;
            }
            if let Some(n) = number_before("bytes spill stores") {
                info.spill_stores = n;
            }
            if let Some(n) = number_before("bytes spill loads") {
                info.spill_loads = n;
            }
            if let Some(n) = number_before("registers") {
                info.registers = n;
            }
            if let Some(n) = number_before("bytes smem") {
                info.shared = n;
            }
        }
        Ok(info)
    }
}

/// How many instructions of each opcode (its first word, without modifiers) the disassembly has.
fn opcode_counts(sass: &str) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for line in sass.lines() {
        // `        /*0080*/                   FFMA R4, R2, R3, R4 ;`
        let Some(rest) = line.trim_start().strip_prefix("/*") else {
            continue;
        };
        let Some((_, instruction)) = rest.split_once("*/") else {
            continue;
        };
        let instruction = instruction.trim_start();
        let instruction = instruction
            .strip_prefix('@')
            .map_or(instruction, |guarded| {
                guarded.split_once(' ').map_or("", |(_, op)| op)
            });
        let Some(op) = instruction.split_whitespace().next() else {
            continue;
        };
        let op = op.split('.').next().unwrap_or(op);
        *counts.entry(op.to_string()).or_default() += 1;
    }
    counts
}
