//! Benchmark bodies shared by the criterion harness (`cargo bench -p attention-bench`) and the
//! JSON runner (`cargo run --release -p attention-bench -- …`): one causal self-attention layer,
//! `input_dim = output_dim = D`, no QKV bias, timed with the device synced inside the timed
//! region; optionally on rows packed from documents ([`packed_documents`]).
#![warn(missing_docs)]

pub mod process;

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use attention_core::{
    AttentionInput, AttentionPath, Documents, KvCache, KvDtype, MultiHeadAttention,
    MultiHeadAttentionConfig, PagePool, PageTable, causal_attention,
};
use burn::backend::Autodiff;
use burn::nn::attention::{
    MhaInput, MultiHeadAttentionConfig as BurnMhaConfig, generate_autoregressive_mask,
};
use burn::prelude::*;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Bool, Distribution, TensorData};

/// `BxTxDxH`: batch, sequence, width, heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Batch size.
    pub batch: usize,
    /// Sequence length (for `decode`: the cache holds `seq - 1`, one token is decoded).
    pub seq: usize,
    /// `input_dim = output_dim`.
    pub dim: usize,
    /// Heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention); `heads` unless set (the runner's
    /// `--num-kv-heads`).
    pub kv_heads: usize,
    /// Sliding window (the runner's `--sliding-window`); none unless set.
    pub window: Option<usize>,
}

impl FromStr for Shape {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let parts: Vec<usize> = text
            .split('x')
            .map(|p| {
                p.parse()
                    .map_err(|_| format!("shape `{text}`: expected BxTxDxH, e.g. 1x1024x768x12"))
            })
            .collect::<Result<_, _>>()?;
        match parts[..] {
            [batch, seq, dim, heads] if parts.iter().all(|&p| p > 0) && dim % heads == 0 => {
                Ok(Self {
                    batch,
                    seq,
                    dim,
                    heads,
                    kv_heads: heads,
                    window: None,
                })
            }
            [_, _, dim, heads] if heads > 0 && dim % heads != 0 => {
                Err(format!("shape `{text}`: {heads} heads do not divide {dim}"))
            }
            _ => Err(format!(
                "shape `{text}`: expected four positive sizes BxTxDxH"
            )),
        }
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}x{}x{}", self.batch, self.seq, self.dim, self.heads)
    }
}

/// The shapes the issue tracks: the chapter's, then GPT-2-small widths.
pub const STANDARD_SHAPES: [&str; 5] = [
    "1x6x4x2",
    "8x128x256x4",
    "4x512x768x12",
    "1x1024x768x12",
    "1x2048x768x12",
];

/// Which attention implementation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Impl {
    /// Ours, explicit path (scores, mask, softmax, weighted sum).
    Explicit,
    /// Ours, fused path: the crate's CPU kernel on ndarray and flex, its GPU kernel on wgpu (each
    /// with its own backward under autodiff).
    Fused,
    /// Our layer with Burn's fused `attention` op for the core (`AttentionPath::BurnOp`): what
    /// `fused` was on wgpu before the GPU kernel.
    BurnOp,
    /// `burn::nn::attention::MultiHeadAttention` with its autoregressive mask.
    BurnNn,
}

/// What is timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Inference forward.
    Fwd,
    /// Forward and backward of `sum(y)` through autodiff.
    Fwdbwd,
    /// One new token with a KV cache holding `seq - 1` tokens.
    Decode,
}

impl Impl {
    /// The layer's path for our implementations.
    fn path(self) -> AttentionPath {
        match self {
            Self::Explicit => AttentionPath::Explicit,
            Self::BurnOp => AttentionPath::BurnOp,
            Self::Fused | Self::BurnNn => AttentionPath::Fused,
        }
    }

    /// The name used in results.
    pub fn name(self) -> &'static str {
        match self {
            Self::Explicit => "explicit",
            Self::Fused => "fused",
            Self::BurnOp => "burn-op",
            Self::BurnNn => "burn-nn",
        }
    }
}

impl Mode {
    /// The name used in results.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fwd => "fwd",
            Self::Fwdbwd => "fwdbwd",
            Self::Decode => "decode",
        }
    }

    /// Nominal FLOPs, as `shared/peers/torch_mha.py` counts them (causal masking not
    /// subtracted; backward = 2 × forward); `decode` counts one token against `seq` keys. The
    /// attention core alone (`core`) leaves out the four projections.
    pub fn flops(self, s: Shape, core: bool) -> f64 {
        let (b, t, d) = (s.batch as f64, s.seq as f64, s.dim as f64);
        let projections = if core { 0.0 } else { 8.0 * b * d * d };
        match self {
            Self::Fwd => projections * t + 4.0 * b * t * t * d,
            Self::Fwdbwd => 3.0 * (projections * t + 4.0 * b * t * t * d),
            Self::Decode => projections + 4.0 * b * t * d,
        }
    }
}

/// One prepared benchmark: call [`Case::iteration`] to run (and sync) once.
pub struct Case {
    run: Box<dyn FnMut()>,
    /// Calls per iteration, all queued before the one sync that ends it.
    calls: usize,
    /// A decoding step's key/value cache, in bytes.
    cache_bytes: Option<usize>,
}

impl Case {
    /// The bytes of keys and values a decoding step's cache holds (`None` for other modes): a
    /// dense cache's allocated positions, or the pages its tables hold.
    pub fn cache_bytes(&self) -> Option<usize> {
        self.cache_bytes
    }

    /// Runs one iteration, device synced before it returns.
    pub fn iteration(&mut self) {
        (self.run)()
    }

    /// Runs `warmup` iterations, then times `repeats`; each time is per call (an iteration's
    /// time divided by its calls).
    pub fn time(&mut self, warmup: usize, repeats: usize) -> Vec<Duration> {
        for _ in 0..warmup {
            self.iteration();
        }
        (0..repeats)
            .map(|_| {
                let start = Instant::now();
                self.iteration();
                start.elapsed() / self.calls as u32
            })
            .collect()
    }
}

/// Why a combination cannot run.
#[derive(Debug, Clone, PartialEq)]
pub struct Unsupported(pub String);

impl fmt::Display for Unsupported {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn sync<B: Backend>(device: &B::Device) {
    B::sync(device).expect("device sync");
}

fn our_layer<B: Backend>(shape: Shape, device: &B::Device) -> MultiHeadAttention<B> {
    B::seed(device, 0);
    MultiHeadAttentionConfig::new(shape.dim, shape.dim, shape.seq, shape.heads)
        .with_num_kv_heads(Some(shape.kv_heads))
        .with_sliding_window(shape.window)
        .init(device)
}

fn input<B: Backend>(shape: Shape, seq: usize, device: &B::Device) -> Tensor<B, 3> {
    Tensor::random(
        [shape.batch, seq, shape.dim],
        Distribution::Normal(0.0, 1.0),
        device,
    )
}

/// A forward closure over `x` for one implementation, on any backend (autodiff or not); with
/// `documents`, our layer's input packs each row from them.
fn forward_fn<B: Backend>(
    implementation: Impl,
    shape: Shape,
    documents: Option<Documents>,
    device: &B::Device,
) -> Box<dyn Fn(Tensor<B, 3>) -> Tensor<B, 3>> {
    match implementation {
        Impl::Explicit | Impl::Fused | Impl::BurnOp => {
            let layer = our_layer::<B>(shape, device);
            let path = implementation.path();
            Box::new(move |x| {
                let input = AttentionInput::new(x).path(path);
                // A clone per call, as a training step hands its batch's documents to the layer.
                let input = match &documents {
                    Some(documents) => input.documents(documents.clone()),
                    None => input,
                };
                layer.try_forward(input).expect("valid shape")
            })
        }
        Impl::BurnNn => {
            B::seed(device, 0);
            let layer = BurnMhaConfig::new(shape.dim, shape.heads)
                .with_dropout(0.0)
                .init::<B>(device);
            let mask = generate_autoregressive_mask::<B>(shape.batch, shape.seq, device);
            Box::new(move |x| {
                layer
                    .forward(MhaInput::self_attn(x).mask_attn(mask.clone()))
                    .context
            })
        }
    }
}

/// A rough upper bound of the bytes `implementation` holds at once in `mode` at `shape`: the
/// input, the weights, the projections, and for paths that materialize them the `[batch, heads,
/// seq, seq]` scores (several copies); three times that under autodiff.
pub fn estimated_bytes(implementation: Impl, mode: Mode, shape: Shape) -> u128 {
    let [batch, seq, dim, heads] =
        [shape.batch, shape.seq, shape.dim, shape.heads].map(|n| n as u128);
    let activations = 8 * batch * seq * dim + 4 * dim * dim;
    let scores = match (implementation, mode) {
        (_, Mode::Decode) | (Impl::Fused, _) | (Impl::BurnOp, Mode::Fwd) => 0,
        _ => 4 * batch * heads * seq * seq,
    };
    let bytes = 4 * (activations + scores);
    if mode == Mode::Fwdbwd {
        3 * bytes
    } else {
        bytes
    }
}

/// The memory this machine has available (Linux's `MemAvailable`), or 16 GiB where unknown.
fn available_bytes() -> u128 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|info| {
            info.lines().find_map(|line| {
                line.strip_prefix("MemAvailable:")
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u128>().ok())
            })
        })
        .map_or(16 << 30, |kib| kib * 1024)
}

/// Whether `implementation` can run `mode` at `shape`, without preparing anything: refused when
/// it has no such mode, or when its buffers would not fit in the memory available.
pub fn supports(implementation: Impl, mode: Mode, shape: Shape) -> Result<(), Unsupported> {
    let needed = estimated_bytes(implementation, mode, shape);
    let available = available_bytes();
    if needed > available {
        let gib = |bytes: u128| bytes as f64 / (1u64 << 30) as f64;
        return Err(Unsupported(format!(
            "{shape}: {} {} needs about {:.1} GiB, more than the {:.1} GiB available",
            implementation.name(),
            mode.name(),
            gib(needed),
            gib(available)
        )));
    }
    if implementation == Impl::BurnNn && (shape.kv_heads != shape.heads || shape.window.is_some()) {
        return Err(Unsupported(
            "burn-nn has no grouped key/value heads or sliding window".into(),
        ));
    }
    if mode != Mode::Decode {
        return Ok(());
    }
    if implementation == Impl::BurnNn {
        return Err(Unsupported(format!(
            "{} has no KV-cache decode here (Burn's MhaCache recomputes every query each step)",
            implementation.name()
        )));
    }
    if shape.seq < 2 {
        return Err(Unsupported(format!(
            "decode needs seq ≥ 2 (a cache of seq - 1), got {shape}"
        )));
    }
    Ok(())
}

/// What a case times: an implementation in a mode at a shape, `calls` calls per sync, its rows
/// whole or packed from documents.
#[derive(Debug, Clone)]
pub struct Timed {
    /// Whose attention.
    pub implementation: Impl,
    /// Forward, forward and backward, or a decoding step.
    pub mode: Mode,
    /// Batch, sequence, width and heads.
    pub shape: Shape,
    /// Calls queued before each sync.
    pub calls: usize,
    /// The documents each row is packed from ([`packed_documents`]); `None`: one per row.
    pub documents: Option<Documents>,
    /// How a decoding step keeps its keys and values, and each row's length.
    pub decode: DecodeRows,
}

/// How a decoding step (`--mode decode`) keeps its keys and values (`--cache`, `--page-size`) and
/// how long each row is (`--lengths`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeRows {
    /// A dense `KvCache` per layer, or a page pool.
    pub cache: CacheKind,
    /// Positions per page of a paged cache.
    pub page_size: usize,
    /// Row `i` decodes one token after `lengths[i] − 1` cached positions; `None`: every row
    /// after `seq − 1`. A dense cache pads the shorter rows to the longest (their padding keys
    /// masked), as a rectangular batch does.
    pub lengths: Option<Vec<usize>>,
    /// What the cache stores keys and values as.
    pub kv_dtype: KvDtype,
}

impl Default for DecodeRows {
    fn default() -> Self {
        Self {
            cache: CacheKind::Dense,
            page_size: PagePool::DEFAULT_PAGE_SIZE,
            lengths: None,
            kv_dtype: KvDtype::Model,
        }
    }
}

/// Where a decoding step's keys and values are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CacheKind {
    /// The layer's `KvCache`: every row's positions side by side, up to the longest.
    Dense,
    /// A page pool: each row's positions in pages of its own, read through its table.
    Paged,
}

impl CacheKind {
    /// The name the runner takes and prints.
    pub fn name(self) -> &'static str {
        match self {
            Self::Dense => "dense",
            Self::Paged => "paged",
        }
    }
}

impl Timed {
    /// Whether this implementation runs this mode at this shape, with its documents: those are
    /// for whole rows of our layer or attention core (not a decoding step, which continues one
    /// sequence per row, nor Burn's layer) and must cover the shape's `[batch, seq]`.
    pub fn supported(&self) -> Result<(), Unsupported> {
        supports(self.implementation, self.mode, self.shape)?;
        self.decode_supported()?;
        let Some(documents) = &self.documents else {
            return Ok(());
        };
        if self.mode == Mode::Decode {
            return Err(Unsupported(
                "--documents packs whole rows: not --mode decode, whose cache continues one \
                 sequence per row"
                    .into(),
            ));
        }
        if self.implementation == Impl::BurnNn {
            return Err(Unsupported(
                "burn-nn has no documents (its mask is the autoregressive one)".into(),
            ));
        }
        let expected = [self.shape.batch, self.shape.seq];
        if documents.shape() != expected {
            return Err(Unsupported(format!(
                "shape `{}`: documents cover [batch, seq] = {:?}, expected {expected:?}",
                self.shape,
                documents.shape()
            )));
        }
        Ok(())
    }
}

impl Timed {
    /// `--cache`, `--page-size`, `--lengths` and `--kv-dtype`: for decoding steps of our layer;
    /// a length per row of the shape, each from 2 (a cached position and a new one) to the
    /// shape's `seq`, the longest equal to it; pages as the pool takes them; a narrow cache on
    /// the fused path (the CPU kernel reads it).
    fn decode_supported(&self) -> Result<(), Unsupported> {
        let DecodeRows {
            cache,
            page_size,
            lengths,
            kv_dtype,
        } = &self.decode;
        if self.mode != Mode::Decode {
            return match (cache, lengths, kv_dtype) {
                (CacheKind::Dense, None, KvDtype::Model) => Ok(()),
                _ => Err(Unsupported(
                    "--cache paged, --lengths and --kv-dtype are for --mode decode".into(),
                )),
            };
        }
        if kv_dtype.is_narrow() && self.implementation != Impl::Fused {
            return Err(Unsupported(format!(
                "--kv-dtype {kv_dtype} is read by our kernels: --impl fused"
            )));
        }
        if *cache == CacheKind::Paged {
            if self.implementation != Impl::Fused {
                return Err(Unsupported(
                    "--cache paged runs our layer's ragged call: --impl fused".into(),
                ));
            }
            PagePool::new(1, *page_size)
                .map_err(|error| Unsupported(format!("--page-size {page_size}: {error}")))?;
        }
        let Some(lengths) = lengths else {
            return Ok(());
        };
        let shape = self.shape;
        if lengths.len() != shape.batch {
            return Err(Unsupported(format!(
                "--lengths gives {} rows, shape `{shape}` has a batch of {}",
                lengths.len(),
                shape.batch
            )));
        }
        if lengths
            .iter()
            .any(|&length| length < 2 || length > shape.seq)
            || lengths.iter().max() != Some(&shape.seq)
        {
            return Err(Unsupported(format!(
                "--lengths: each from 2 to {} (shape `{shape}`'s seq), the longest equal to it",
                shape.seq
            )));
        }
        Ok(())
    }
}

/// Every row of `shape` packed from documents of `lengths` tokens, in order (the runner's
/// `--documents`).
///
/// # Errors
/// When a length is 0 or the lengths do not add up to the shape's sequence.
pub fn packed_documents(shape: Shape, lengths: &[usize]) -> Result<Documents, Unsupported> {
    let listed = lengths
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",");
    if let Some(document) = lengths.iter().position(|&length| length == 0) {
        return Err(Unsupported(format!(
            "--documents {listed}: document {document} has 0 tokens; every document has one at \
             least"
        )));
    }
    // Added with a check: lengths are the user's, and a wrapped sum could equal the sequence.
    let sum = lengths
        .iter()
        .try_fold(0usize, |sum, &length| sum.checked_add(length));
    if sum != Some(shape.seq) {
        let sum = match sum {
            Some(sum) => format!("{sum} tokens"),
            None => "more tokens than a usize holds".to_string(),
        };
        return Err(Unsupported(format!(
            "--documents {listed}: the lengths add up to {sum}, but shape `{shape}` has rows of {} \
             tokens",
            shape.seq
        )));
    }
    Documents::from_lengths(&vec![lengths.to_vec(); shape.batch])
        .map_err(|error| Unsupported(format!("--documents {listed}: {error}")))
}

/// Prepares the whole layer as `timed` says, on backend `B`.
pub fn prepare<B: Backend>(timed: Timed, device: &B::Device) -> Result<Case, Unsupported> {
    timed.supported()?;
    let Timed {
        implementation,
        mode,
        shape,
        calls,
        documents,
        decode,
    } = timed;
    let device = device.clone();
    match mode {
        Mode::Fwd => {
            let forward = forward_fn::<B>(implementation, shape, documents, &device);
            let x = input::<B>(shape, shape.seq, &device);
            Ok(Case {
                run: Box::new(move || {
                    for _ in 0..calls {
                        drop(forward(x.clone()));
                    }
                    sync::<B>(&device);
                }),
                calls,
                cache_bytes: None,
            })
        }
        Mode::Fwdbwd => {
            let forward = forward_fn::<Autodiff<B>>(implementation, shape, documents, &device);
            let x = input::<Autodiff<B>>(shape, shape.seq, &device).require_grad();
            Ok(Case {
                run: Box::new(move || {
                    for _ in 0..calls {
                        drop(forward(x.clone()).sum().backward());
                    }
                    sync::<B>(&device);
                }),
                calls,
                cache_bytes: None,
            })
        }
        Mode::Decode => match decode.cache {
            CacheKind::Dense => Ok(dense_decode::<B>(
                implementation,
                shape,
                calls,
                (decode.lengths, decode.kv_dtype),
                &device,
            )),
            CacheKind::Paged => Ok(paged_decode::<B>(shape, calls, &decode, &device)),
        },
    }
}

/// One decoding step of every row over a dense `KvCache` of `kv_dtype` after `seq − 1`
/// positions: rows shorter than that (`lengths`) are left-padded, their padding keys masked.
fn dense_decode<B: Backend>(
    implementation: Impl,
    shape: Shape,
    calls: usize,
    (lengths, kv_dtype): (Option<Vec<usize>>, KvDtype),
    device: &B::Device,
) -> Case {
    let layer = our_layer::<B>(shape, device);
    let mut cache: KvCache<B> = layer.new_cache().with_kv_dtype(kv_dtype);
    let padding = lengths.map(|lengths| {
        let padded: Vec<bool> = lengths
            .iter()
            .flat_map(|&length| (0..shape.seq).map(move |position| position + length < shape.seq))
            .collect();
        Tensor::<B, 2, Bool>::from_data(TensorData::new(padded, [shape.batch, shape.seq]), device)
    });
    let prefill = AttentionInput::new(input::<B>(shape, shape.seq - 1, device));
    let prefill = match &padding {
        Some(padding) => prefill.key_padding(padding.clone().narrow(1, 0, shape.seq - 1)),
        None => prefill,
    };
    layer
        .forward_cached(prefill, &mut cache)
        .expect("prefill fits");
    let token = input::<B>(shape, 1, device);
    let path = implementation.path();
    let float_bytes = size_of::<B::FloatElem>();
    let row_bytes = kv_dtype.row_bytes(shape.dim / shape.heads, float_bytes);
    let cache_bytes = cache.allocated() * shape.batch * 2 * shape.kv_heads * row_bytes;
    let device = device.clone();
    Case {
        run: Box::new(move || {
            for _ in 0..calls {
                let step = AttentionInput::new(token.clone()).path(path);
                let step = match &padding {
                    Some(padding) => step.key_padding(padding.clone()),
                    None => step,
                };
                let y = layer
                    .forward_cached(step, &mut cache)
                    .expect("room for one");
                drop(y);
                cache.truncate(shape.seq - 1).expect("no window");
            }
            sync::<B>(&device);
        }),
        calls,
        cache_bytes: Some(cache_bytes),
    }
}

/// One decoding step of every row over a page pool, row `i` after `lengths[i] − 1` cached
/// positions in pages of its own: one ragged call. Each timed call runs the same reserved step
/// (its token written over the same slot), as the dense case rewinds its cache.
fn paged_decode<B: Backend>(
    shape: Shape,
    calls: usize,
    decode: &DecodeRows,
    device: &B::Device,
) -> Case {
    let layer = our_layer::<B>(shape, device);
    let lengths = decode
        .lengths
        .clone()
        .unwrap_or_else(|| vec![shape.seq; shape.batch]);
    let pages: usize = lengths
        .iter()
        .map(|length| length.div_ceil(decode.page_size))
        .sum();
    let mut pool = PagePool::new(pages, decode.page_size)
        .expect("checked page size")
        .with_kv_dtype(decode.kv_dtype);
    let mut storage = layer.new_pages(&pool).expect("pages fit");
    let mut tables: Vec<PageTable> = lengths
        .iter()
        .map(|_| PageTable::new(shape.seq, shape.window))
        .collect();
    // The prompts, one sequence a call.
    for (table, &length) in tables.iter_mut().zip(&lengths) {
        let step = pool
            .step(&mut [(table, length - 1)])
            .expect("pages for the prompt");
        let x = Tensor::random(
            [1, length - 1, shape.dim],
            Distribution::Normal(0.0, 1.0),
            device,
        );
        layer
            .forward_paged(x, &step, &mut storage)
            .expect("prompt fits");
    }
    let mut sequences: Vec<(&mut PageTable, usize)> =
        tables.iter_mut().map(|table| (table, 1)).collect();
    let step = pool.step(&mut sequences).expect("pages for a token each");
    let held: usize = tables.iter().map(PageTable::pages_held).sum();
    let cache_bytes = held * decode.page_size * storage.bytes_per_position();
    let token = Tensor::random(
        [1, shape.batch, shape.dim],
        Distribution::Normal(0.0, 1.0),
        device,
    );
    let device = device.clone();
    Case {
        run: Box::new(move || {
            for _ in 0..calls {
                let y = layer
                    .forward_paged(token.clone(), &step, &mut storage)
                    .expect("the reserved step");
                drop(y);
            }
            sync::<B>(&device);
        }),
        calls,
        cache_bytes: Some(cache_bytes),
    }
}

/// The attention core alone (the queries, keys and values in the layer's layout → the context),
/// as `timed` says, on backend `B`: ours ([`Impl::Fused`], [`causal_attention`]) or Burn's
/// attention op ([`Impl::BurnOp`], on the heads split apart, the split, the key/value heads'
/// repetition and a window's or the documents' mask made before the timed calls). A decoding step
/// is one query over `seq` keys.
pub fn prepare_core<B: Backend>(timed: Timed, device: &B::Device) -> Result<Case, Unsupported> {
    timed.supported()?;
    let Timed {
        implementation,
        mode,
        shape,
        calls,
        documents,
        decode,
    } = timed;
    if decode.cache != CacheKind::Dense || decode.lengths.is_some() {
        return Err(Unsupported(
            "--cache paged and --lengths time the layer's decoding step, not --core".into(),
        ));
    }
    if !matches!(implementation, Impl::Fused | Impl::BurnOp) {
        return Err(Unsupported(format!(
            "--core times `fused` (ours) or `burn-op`, not `{}`",
            implementation.name()
        )));
    }
    let device = device.clone();
    match mode {
        Mode::Fwd | Mode::Decode => {
            let core = core_fn::<B>(implementation, mode, shape, documents, &device);
            Ok(Case {
                run: Box::new(move || {
                    for _ in 0..calls {
                        drop(core());
                    }
                    sync::<B>(&device);
                }),
                calls,
                cache_bytes: None,
            })
        }
        Mode::Fwdbwd => {
            let core = core_fn::<Autodiff<B>>(implementation, mode, shape, documents, &device);
            Ok(Case {
                run: Box::new(move || {
                    for _ in 0..calls {
                        drop(core().sum().backward());
                    }
                    sync::<B>(&device);
                }),
                calls,
                cache_bytes: None,
            })
        }
    }
}

/// One call of the attention core on inputs made once, tracked for gradients under `Autodiff`;
/// with `documents` (whole rows, not a decoding step), each query sees its own document's keys.
fn core_fn<B: Backend>(
    implementation: Impl,
    mode: Mode,
    shape: Shape,
    documents: Option<Documents>,
    device: &B::Device,
) -> Box<dyn Fn() -> Tensor<B, 3>> {
    let head_dim = shape.dim / shape.heads;
    let queries = if mode == Mode::Decode { 1 } else { shape.seq };
    let random = |seq: usize, heads: usize| {
        Tensor::<B, 3>::random(
            [shape.batch, seq, heads * head_dim],
            Distribution::Normal(0.0, 1.0),
            device,
        )
        .require_grad()
    };
    let (q, k, v) = (
        random(queries, shape.heads),
        random(shape.seq, shape.kv_heads),
        random(shape.seq, shape.kv_heads),
    );
    let (heads, window) = (shape.heads, shape.window);
    if implementation == Impl::Fused {
        return Box::new(move || {
            let (q, k, v) = (q.clone(), k.clone(), v.clone());
            causal_attention(q, k, v, heads, window, documents.as_ref()).expect("shapes fit")
        });
    }
    let group = shape.heads / shape.kv_heads;
    let split = move |tensor: Tensor<B, 3>, heads: usize| {
        let [batch, seq, _] = tensor.dims();
        tensor
            .reshape([batch, seq, heads, head_dim])
            .swap_dims(1, 2)
    };
    let repeated = move |tensor: Tensor<B, 3>| {
        let [batch, keys, _] = tensor.dims();
        split(tensor, shape.kv_heads)
            .reshape([batch, shape.kv_heads, 1, keys, head_dim])
            .expand([batch, shape.kv_heads, group, keys, head_dim])
            .reshape([batch, heads, keys, head_dim])
    };
    let (q, k, v) = (split(q, heads), repeated(k), repeated(v));
    // Burn's op is causal by a flag or by a mask, not both: with a window or documents the mask
    // holds the causal part as well as theirs.
    let mask = (window.is_some() || documents.is_some()).then(|| {
        let past = shape.seq - queries;
        let causal = attention_core::mask::attention_mask::<B>(
            [shape.batch, heads, queries, past],
            None,
            window,
            device,
        );
        match &documents {
            Some(documents) => {
                let [batch, seq] = documents.shape();
                let other_documents = documents
                    .mask::<B>(device)
                    .reshape([batch, 1, seq, seq])
                    .expand([batch, heads, seq, seq]);
                causal.bool_or(other_documents)
            }
            None => causal,
        }
    });
    let options = AttentionModuleOptions {
        scale: None,
        softcap: None,
        is_causal: mode != Mode::Decode && mask.is_none(),
    };
    Box::new(move || {
        let context = attention(q.clone(), k.clone(), v.clone(), mask.clone(), None, options);
        let [batch, _, seq, _] = context.dims();
        context
            .swap_dims(1, 2)
            .reshape([batch, seq, heads * head_dim])
    })
}
