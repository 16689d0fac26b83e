//! The command line, the same for every demo.

use std::path::PathBuf;

use attention_core::{AttentionPath, KvDtype};
use clap::{Args, Parser, Subcommand, ValueEnum};

/// Causal multi-head attention (the GPT layer of the source chapter) on one Burn backend.
#[derive(Debug, Parser)]
#[command(version, about)]
pub struct Cli {
    /// What to run; `walkthrough` when omitted.
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// The chapter's example: 6 tokens, 4 features, 2 heads; prints scores, masked scores and
    /// attention weights.
    Walkthrough(WalkthroughArgs),
    /// Checks autodiff gradients for the input and every parameter.
    Gradcheck(GradcheckArgs),
    /// Runs a PyTorch-trained layer on given inputs and writes its outputs (and gradients).
    Apply(ApplyArgs),
    /// Draws attention weights as a PNG heatmap, one panel per head.
    Heatmap(HeatmapArgs),
}

impl Default for Command {
    fn default() -> Self {
        Self::Walkthrough(WalkthroughArgs { seed: 0 })
    }
}

/// `walkthrough` options.
#[derive(Debug, Args)]
pub struct WalkthroughArgs {
    /// Seed of the random input and weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// `gradcheck` options.
#[derive(Debug, Args)]
pub struct GradcheckArgs {
    /// Seed of the random inputs and weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// The attention path of `apply`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PathArg {
    /// Scores, mask, softmax, weighted sum (writes `attn_weights`).
    Explicit,
    /// The fused path: this crate's CPU kernel on ndarray and flex, Burn's attention op on wgpu.
    Fused,
    /// One token at a time through a KV cache (Burn's attention op over the cached keys); whole
    /// sequences only, so not with an input's `segment_ids`.
    Cached,
}

impl PathArg {
    /// The layer's path (`cached` decodes on the default path).
    pub fn attention_path(self) -> AttentionPath {
        match self {
            Self::Explicit => AttentionPath::Explicit,
            Self::Fused => AttentionPath::Fused,
            Self::Cached => AttentionPath::Auto,
        }
    }
}

/// Which features of a head the rotary embedding pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RopeLayoutArg {
    /// Feature `i` with `i + head_dim / 2` (Hugging Face's `rotate_half`).
    Half,
    /// Features `2i` and `2i + 1` (Meta's original Llama).
    Interleaved,
}

/// Over which features the q/k norms of `apply` take their mean square.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum QkNormArg {
    /// Each head's `head_dim` features (Qwen3, Gemma 3).
    Head,
    /// The whole projected width, before the head split (OLMo2).
    Width,
}

/// `apply` options.
#[derive(Debug, Args)]
pub struct ApplyArgs {
    /// PyTorch weights: `.safetensors` or `.pt` state dict, in the chapter's, GPT-2's or Hugging
    /// Face Llama's (`q_proj`, `k_proj`, `v_proj`, `o_proj`) layout.
    #[arg(long)]
    pub weights: PathBuf,
    /// Number of (query) attention heads (a state dict does not record it).
    #[arg(long)]
    pub num_heads: usize,
    /// Key/value heads; default: what the key projection's shape says. Checked against it.
    #[arg(long)]
    pub num_kv_heads: Option<usize>,
    /// Features per head; default: the query projection's width / heads. Checked against it.
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// Rotary position embeddings with this base (e.g. `10000.0`); without it, no RoPE.
    #[arg(long)]
    pub rope_theta: Option<f64>,
    /// Hugging Face's `rope_scaling` JSON, e.g. `{"rope_type":"llama3","factor":8.0,...}`.
    #[arg(long, requires = "rope_theta")]
    pub rope_scaling: Option<String>,
    /// Which features the rotary embedding pairs.
    #[arg(long, value_enum, default_value_t = RopeLayoutArg::Half, requires = "rope_theta")]
    pub rope_layout: RopeLayoutArg,
    /// Partial rotary embeddings: only the first N features of each head turn (even, at most
    /// head_dim; Phi-3's `head_dim · partial_rotary_factor`); default: all of them.
    #[arg(long, value_name = "N", requires = "rope_theta")]
    pub rotary_dim: Option<usize>,
    /// RMSNorms of the queries and keys (`q_norm.weight`, `k_norm.weight` in the weights) over
    /// each head or the whole projected width; default: what the weights' shapes say (none
    /// without those keys).
    #[arg(long, value_enum)]
    pub qk_norm: Option<QkNormArg>,
    /// The q/k norms' epsilon (the model's `rms_norm_eps`); default: 1e-6.
    #[arg(long, value_name = "E")]
    pub qk_norm_eps: Option<f64>,
    /// The q/k norms multiply by `1 + w` (Gemma's convention) instead of `w`.
    #[arg(long)]
    pub qk_norm_unit_offset: bool,
    /// Keys each query sees at most, its own included.
    #[arg(long)]
    pub sliding_window: Option<usize>,
    /// Multiplies the scores `q kᵀ` instead of 1/√head_dim (Gemma: `query_pre_attn_scalar^-0.5`).
    #[arg(long, value_name = "S")]
    pub scale: Option<f64>,
    /// Soft-caps the scaled scores, `c · tanh(s / c)` (Gemma 2: `attn_logit_softcapping`).
    #[arg(long, value_name = "C")]
    pub softcap: Option<f64>,
    /// Safetensors file with tensor `x` `[batch, seq, input_dim]`, and optionally
    /// `position_ids` `[batch, seq]` (int64): the rotary positions, and `segment_ids`
    /// `[batch, seq]` (int64): rows packed from documents, a run of equal ids being one document
    /// (ids at least 0, not decreasing along a row), each token attending within its own
    /// (not with `--path cached`).
    #[arg(long)]
    pub input: PathBuf,
    /// Safetensors file to write: `y`, `attn_weights` (explicit path), and with `--cotangent`
    /// `grad.x` and `grad.<key>` for every parameter key of the weights.
    #[arg(long)]
    pub output: PathBuf,
    /// Safetensors file with tensor `r` shaped like `y`: also write the gradients of
    /// `sum(y * r)`.
    #[arg(long)]
    pub cotangent: Option<PathBuf>,
    /// Longest sequence; default: the `mask` buffer's size when the weights have one, else seq.
    #[arg(long)]
    pub context_length: Option<usize>,
    /// How the attention core is computed.
    #[arg(long, value_enum, default_value_t = PathArg::Explicit)]
    pub path: PathArg,
    /// With `--path cached`: what the cache stores keys and values as, `f32` (the layer's float
    /// type), `f16`, `bf16` or `int8` (rounded once when written; read by the CPU kernel, so
    /// ndarray or burn-flex and no `--cotangent`).
    #[arg(long, default_value_t = KvDtype::Model)]
    pub kv_dtype: KvDtype,
}

/// `heatmap` options.
#[derive(Debug, Args)]
pub struct HeatmapArgs {
    /// The PNG to write.
    #[arg(long, default_value = "attention-heatmap.png")]
    pub output: PathBuf,
    /// Seed of the walkthrough's input and weights (without `--weights`).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Draw a given layer instead of the walkthrough's (needs `--input` and `--num-heads`).
    #[arg(long, requires_all = ["input", "num_heads"])]
    pub weights: Option<PathBuf>,
    /// Safetensors file with tensor `x`; the first sequence of the batch is drawn.
    #[arg(long, requires = "weights")]
    pub input: Option<PathBuf>,
    /// Number of heads of `--weights`.
    #[arg(long, requires = "weights")]
    pub num_heads: Option<usize>,
}
