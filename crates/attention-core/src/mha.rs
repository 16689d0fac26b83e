//! The layer: [`MultiHeadAttentionConfig`] and [`MultiHeadAttention`].

use burn::module::Param;
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::{Bool, Int};

use crate::attend::{self, AttentionPath, AttentionScores, ScoreRule};
use crate::cache::KvCache;
use crate::error::AttentionError;
use crate::kernels::{self, CachedInputs, KernelInputs, NewKv};
use crate::projection;
use crate::qk_norm::{QkNorm, QkNormConfig, QkNormScope};
use crate::rope::{Positions, RopeConfig, Rotary};
use crate::route::{Call, Route, route};

/// Configuration of a causal [`MultiHeadAttention`] layer, with the parameter names of the source
/// chapter's `MultiHeadAttention(input_dim, output_dim, context_length, dropout, num_heads,
/// qkv_bias)`, and what the Llama family adds: grouped key/value heads, a head width of its own,
/// rotary positions (on part of each head too) and a sliding window; RMSNorms of the queries
/// and keys (Qwen3, Gemma 3, OLMo2); and what changes the scores: a scale of their own and a
/// soft-cap (Gemma), learned sinks (gpt-oss).
///
/// ```
/// # use attention_core::{MultiHeadAttentionConfig, RopeConfig};
/// // Mistral-style: 32 query heads sharing 8 key/value heads, RoPE, a 4096-token window.
/// let config = MultiHeadAttentionConfig::new(4096, 4096, 32768, 32)
///     .with_num_kv_heads(Some(8))
///     .with_output_bias(false)
///     .with_rope(Some(RopeConfig::new().with_theta(1e6)))
///     .with_sliding_window(Some(4096));
/// assert!(config.validate().is_ok());
/// ```
#[derive(Config, Debug)]
pub struct MultiHeadAttentionConfig {
    /// Features of each input token.
    pub input_dim: usize,
    /// Features of each output token (the output projection's width).
    pub output_dim: usize,
    /// The longest sequence the layer accepts (and the capacity of its [`KvCache`]).
    pub context_length: usize,
    /// Number of query heads; must divide `output_dim` unless `head_dim` is given.
    pub num_heads: usize,
    /// Dropout probability on the attention weights, applied after the softmax. Default: `0.0`.
    /// Active only on an autodiff backend, as Burn's [`Dropout`] is.
    #[config(default = 0.0)]
    pub dropout: f64,
    /// Whether the query, key and value projections have a bias. Default: `false`.
    #[config(default = false)]
    pub qkv_bias: bool,
    /// Whether the output projection has a bias. Default: `true` (the chapter's layer; Llama,
    /// Qwen2 and Mistral have none).
    #[config(default = true)]
    pub output_bias: bool,
    /// Key/value heads, shared by groups of `num_heads / num_kv_heads` query heads (query head
    /// `i` reads key/value head `i / (num_heads / num_kv_heads)`, as Hugging Face's `repeat_kv`);
    /// must divide `num_heads`. Default: `num_heads` (multi-head attention); 1 is multi-query.
    #[config(default = "None")]
    pub num_kv_heads: Option<usize>,
    /// Features per head. Default: `output_dim / num_heads`.
    #[config(default = "None")]
    pub head_dim: Option<usize>,
    /// Rotary position embeddings on queries and keys. Default: none (the chapter's layer has no
    /// positions of its own).
    #[config(default = "None")]
    pub rope: Option<RopeConfig>,
    /// Keys each query sees at most, its own included (query `i` sees `j` iff `j ≤ i` and
    /// `i − j < window`). Default: every earlier key.
    #[config(default = "None")]
    pub sliding_window: Option<usize>,
    /// RMSNorms with learned weights on the queries and keys, after the projections and before
    /// RoPE: per head (Qwen3, Gemma 3) or over the whole projected width (OLMo2). Default: none.
    #[config(default = "None")]
    pub qk_norm: Option<QkNormConfig>,
    /// Multiplies `q kᵀ` in place of `1/√head_dim` (Gemma: `query_pre_attn_scalar^-½`); finite
    /// and positive. Default: `1/√head_dim`.
    #[config(default = "None")]
    pub scale: Option<f64>,
    /// Soft-caps the scaled scores to `(−c, c)` as `c · tanh(s / c)`, before the mask (Gemma 2's
    /// `attn_logit_softcapping`); finite and positive. Default: none.
    #[config(default = "None")]
    pub softcap: Option<f64>,
    /// Learned attention sinks: one logit per query head that joins its softmax's denominator
    /// and takes no value (gpt-oss, StreamingLLM), so a head can attend to nothing. Initialized
    /// to 0. Default: `false`.
    #[config(default = false)]
    pub sinks: bool,
}

impl MultiHeadAttentionConfig {
    /// Checks the config: every size at least 1, `num_heads` divides `output_dim` (without a
    /// `head_dim`), `num_kv_heads` divides `num_heads`, `dropout` in `[0, 1)`, the rotary
    /// embedding's parameters (and an even rotated width), a window of at least 1, the q/k
    /// norms' epsilon, and a finite, positive scale and soft-cap.
    pub fn validate(&self) -> Result<(), AttentionError> {
        for (name, value) in [
            ("input_dim", self.input_dim),
            ("output_dim", self.output_dim),
            ("context_length", self.context_length),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads.unwrap_or(1)),
            ("head_dim", self.head_dim.unwrap_or(1)),
            ("sliding_window", self.sliding_window.unwrap_or(1)),
        ] {
            if value == 0 {
                return Err(AttentionError::ZeroSize { name });
            }
        }
        if self.head_dim.is_none() && !self.output_dim.is_multiple_of(self.num_heads) {
            return Err(AttentionError::HeadsDoNotDivide {
                output_dim: self.output_dim,
                num_heads: self.num_heads,
            });
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads()) {
            return Err(AttentionError::KvHeadsDoNotDivide {
                num_heads: self.num_heads,
                num_kv_heads: self.num_kv_heads(),
            });
        }
        // Written so that NaN fails too.
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(AttentionError::DropoutOutOfRange(self.dropout));
        }
        if let Some(rope) = &self.rope {
            rope.validate(self.head_dim())?;
        }
        if let Some(qk_norm) = &self.qk_norm {
            qk_norm.validate()?;
        }
        for (name, value) in [("scale", self.scale), ("softcap", self.softcap)] {
            match value {
                // Written so that NaN fails too.
                Some(value) if !(value.is_finite() && value > 0.0) => {
                    return Err(AttentionError::ScoreParameter { name, value });
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Width of one head: `head_dim` if given, else `output_dim / num_heads`.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.output_dim / self.num_heads)
    }

    /// Key/value heads: `num_kv_heads` if given, else `num_heads`.
    pub fn num_kv_heads(&self) -> usize {
        self.num_kv_heads.unwrap_or(self.num_heads)
    }

    /// Initializes a layer with PyTorch's default `nn.Linear` initialization
    /// (`U(-1/√fan_in, 1/√fan_in)`) and q/k norms that scale by 1, or says what is wrong with
    /// the config.
    pub fn try_init<B: Backend>(
        &self,
        device: &B::Device,
    ) -> Result<MultiHeadAttention<B>, AttentionError> {
        self.validate()?;
        let (head_dim, kv_heads) = (self.head_dim(), self.num_kv_heads());
        let projection = |heads: usize| {
            LinearConfig::new(self.input_dim, heads * head_dim)
                .with_bias(self.qkv_bias)
                .init(device)
        };
        // A norm over one head's features, or over the projection's `heads · head_dim`.
        let norm = |heads: usize| {
            self.qk_norm.as_ref().map(|config| {
                let width = match config.scope {
                    QkNormScope::Head => head_dim,
                    QkNormScope::Width => heads * head_dim,
                };
                config.init::<B>(width, device)
            })
        };
        Ok(MultiHeadAttention {
            query_layer: projection(self.num_heads),
            key_layer: projection(kv_heads),
            value_layer: projection(kv_heads),
            query_norm: norm(self.num_heads),
            key_norm: norm(kv_heads),
            output_layer: LinearConfig::new(self.num_heads * head_dim, self.output_dim)
                .with_bias(self.output_bias)
                .init(device),
            sinks: self
                .sinks
                .then(|| Param::from_tensor(Tensor::zeros([self.num_heads], device))),
            dropout: DropoutConfig::new(self.dropout).init(),
            num_heads: self.num_heads,
            num_kv_heads: kv_heads,
            head_dim,
            context_length: self.context_length,
            rope: self.rope.clone(),
            rotary: self.rope.as_ref().map(|rope| Rotary::new(rope, head_dim)),
            sliding_window: self.sliding_window,
            qk_norm: self.qk_norm.clone(),
            scale: self.scale,
            softcap: self.softcap,
        })
    }

    /// Initializes a layer, like [`try_init`](Self::try_init).
    ///
    /// # Panics
    /// With the [`AttentionError`]'s message if the config is invalid.
    pub fn init<B: Backend>(&self, device: &B::Device) -> MultiHeadAttention<B> {
        self.try_init(device)
            .unwrap_or_else(|error| panic!("{error}"))
    }
}

/// Causal multi-head self-attention, as in GPT, and as in Llama with grouped key/value heads,
/// rotary positions, a sliding window and q/k norms when its config asks for them.
///
/// `y = output_layer(merge_heads(dropout(softmax(mask(q kᵀ) / √head_dim)) v))` (the scale, a
/// soft-cap and sinks as the config says, see [`MultiHeadAttentionConfig::sinks`]) with
/// `q, k, v = query_layer(x), key_layer(x), value_layer(x)` split into heads (head `j` owns
/// features `[j·head_dim, (j+1)·head_dim)`), `q` and `k` normalized by `query_norm` and `key_norm`
/// (per head, or over the projection's width before the split) and then rotated by their
/// positions, when the layer has these, and query head `i` attending with key/value head
/// `i / (heads / kv_heads)`. The field names are the keys of the reference's PyTorch
/// `state_dict`, so weights map one to one (see [`crate::weights`] for the GPT-2 and Hugging Face
/// Llama key names).
///
/// Burn's [`Linear`] stores its weight as `[in, out]`, the transpose of PyTorch's `nn.Linear`.
#[derive(Module, Debug)]
pub struct MultiHeadAttention<B: Backend> {
    /// Query projection, `input_dim → num_heads · head_dim`.
    pub query_layer: Linear<B>,
    /// Key projection, `input_dim → num_kv_heads · head_dim`.
    pub key_layer: Linear<B>,
    /// Value projection, `input_dim → num_kv_heads · head_dim`.
    pub value_layer: Linear<B>,
    /// Output projection, `num_heads · head_dim → output_dim`.
    pub output_layer: Linear<B>,
    /// RMSNorm of the queries, if the config has [`qk_norm`](MultiHeadAttentionConfig::qk_norm):
    /// over `head_dim` features ([`QkNormScope::Head`]) or `num_heads · head_dim`
    /// ([`QkNormScope::Width`]).
    pub query_norm: Option<QkNorm<B>>,
    /// RMSNorm of the keys, if the config has [`qk_norm`](MultiHeadAttentionConfig::qk_norm):
    /// over `head_dim` features ([`QkNormScope::Head`]) or `num_kv_heads · head_dim`
    /// ([`QkNormScope::Width`]).
    pub key_norm: Option<QkNorm<B>>,
    /// One sink logit per query head, `[num_heads]`, if the config has
    /// [`sinks`](MultiHeadAttentionConfig::sinks).
    pub sinks: Option<Param<Tensor<B, 1>>>,
    /// Dropout on the attention weights (after the softmax).
    pub dropout: Dropout,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    context_length: usize,
    #[module(skip)]
    rope: Option<RopeConfig>,
    /// The rotary embedding made from `rope` once, with its table of angles.
    #[module(skip)]
    rotary: Option<Rotary>,
    #[module(skip)]
    sliding_window: Option<usize>,
    /// Where `query_norm` and `key_norm` apply, and with which epsilon and convention.
    #[module(skip)]
    qk_norm: Option<QkNormConfig>,
    #[module(skip)]
    scale: Option<f64>,
    #[module(skip)]
    softcap: Option<f64>,
}

/// A forward pass's input beyond the tokens: an optional key-padding mask, the tokens' positions
/// (for rotary embeddings) and the path to take.
///
/// ```
/// # use attention_core::{AttentionInput, AttentionPath};
/// # use burn::backend::NdArray;
/// # use burn::prelude::*;
/// # let device = Default::default();
/// let x = Tensor::<NdArray, 3>::zeros([2, 3, 4], &device);
/// // The first sequence is left-padded by one token.
/// let padding = Tensor::<NdArray, 2, Bool>::from_bool(
///     TensorData::from([[true, false, false], [false, false, false]]),
///     &device,
/// );
/// let input = AttentionInput::new(x).key_padding(padding).path(AttentionPath::Explicit);
/// ```
#[derive(Debug, Clone)]
pub struct AttentionInput<B: Backend> {
    x: Tensor<B, 3>,
    key_padding: Option<Tensor<B, 2, Bool>>,
    positions: Option<Tensor<B, 2, Int>>,
    path: AttentionPath,
}

impl<B: Backend> AttentionInput<B> {
    /// Tokens `x` of shape `[batch, seq, input_dim]`, no padding, positions counted from the
    /// first token (or from the cache's length), [`AttentionPath::Auto`].
    pub fn new(x: Tensor<B, 3>) -> Self {
        Self {
            x,
            key_padding: None,
            positions: None,
            path: AttentionPath::Auto,
        }
    }

    /// Marks padding tokens, which no query attends to. With a cache, the mask covers the cached
    /// positions too (as Hugging Face's `attention_mask` does).
    ///
    /// # Shapes
    /// - `mask`: `[batch, seq]`, or `[batch, cached + seq]` with a cache; `true` = padding
    pub fn key_padding(mut self, mask: Tensor<B, 2, Bool>) -> Self {
        self.key_padding = Some(mask);
        self
    }

    /// The rotary positions of every token, per row: a left-padded row counts its positions from
    /// its first real token (Hugging Face's `cumsum(attention_mask) − 1`). Without them, row
    /// positions are `cached, cached + 1, …`. Ignored by a layer without RoPE.
    ///
    /// # Shapes
    /// - `positions`: `[batch, seq]`
    pub fn positions(mut self, positions: Tensor<B, 2, Int>) -> Self {
        self.positions = Some(positions);
        self
    }

    /// Chooses how the attention core is computed.
    pub fn path(mut self, path: AttentionPath) -> Self {
        self.path = path;
        self
    }
}

/// What the source chapter prints during a forward pass, with the output.
#[derive(Debug, Clone)]
pub struct AttentionTrace<B: Backend> {
    /// The layer's output, `[batch, seq, output_dim]`.
    pub output: Tensor<B, 3>,
    /// `q kᵀ` per head, before scaling: `[batch, heads, seq, seq]`.
    pub scores: Tensor<B, 4>,
    /// The scores with `-inf` above the diagonal: `[batch, heads, seq, seq]`.
    pub masked_scores: Tensor<B, 4>,
    /// `softmax(masked_scores / √head_dim)` before dropout: `[batch, heads, seq, seq]`; rows sum
    /// to 1 and the upper triangle is exactly 0.
    pub weights: Tensor<B, 4>,
}

impl<B: Backend> MultiHeadAttention<B> {
    /// Number of attention heads.
    pub fn num_heads(&self) -> usize {
        self.num_heads
    }

    /// The longest sequence the layer accepts.
    pub fn context_length(&self) -> usize {
        self.context_length
    }

    /// Features of each input token.
    pub fn input_dim(&self) -> usize {
        self.query_layer.weight.dims()[0]
    }

    /// Features of each output token.
    pub fn output_dim(&self) -> usize {
        self.output_layer.weight.dims()[1]
    }

    /// Width of one head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Key/value heads.
    pub fn num_kv_heads(&self) -> usize {
        self.num_kv_heads
    }

    /// Keys each query sees at most, if the layer has a sliding window.
    pub fn sliding_window(&self) -> Option<usize> {
        self.sliding_window
    }

    /// The config this layer answers to.
    pub fn config(&self) -> MultiHeadAttentionConfig {
        MultiHeadAttentionConfig::new(
            self.input_dim(),
            self.output_dim(),
            self.context_length,
            self.num_heads,
        )
        .with_dropout(self.dropout.prob)
        .with_qkv_bias(self.query_layer.bias.is_some())
        .with_output_bias(self.output_layer.bias.is_some())
        .with_num_kv_heads((self.num_kv_heads != self.num_heads).then_some(self.num_kv_heads))
        .with_head_dim(
            (self.num_heads * self.head_dim != self.output_dim()).then_some(self.head_dim),
        )
        .with_rope(self.rope.clone())
        .with_sliding_window(self.sliding_window)
        .with_qk_norm(self.qk_norm.clone())
        .with_scale(self.scale)
        .with_softcap(self.softcap)
        .with_sinks(self.sinks.is_some())
    }

    /// Causal self-attention over `x`.
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, input_dim]` with `1 ≤ seq ≤ context_length`
    /// - output: `[batch, seq, output_dim]`
    ///
    /// # Panics
    /// With the message of [`try_forward`](Self::try_forward)'s error.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.try_forward(x)
            .unwrap_or_else(|error| panic!("{error}"))
    }

    /// Causal self-attention over `x`, or the reason `x` does not fit the layer.
    ///
    /// Takes [`AttentionPath::Auto`]: the fused path, except under autodiff with active dropout
    /// or on a backend without a fused backward of this crate's (see [`AttentionPath::Auto`]).
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, input_dim]` with `1 ≤ seq ≤ context_length`
    /// - output: `[batch, seq, output_dim]`
    pub fn try_forward(&self, x: Tensor<B, 3>) -> Result<Tensor<B, 3>, AttentionError> {
        self.forward_with(AttentionInput::new(x))
    }

    /// Causal self-attention with an optional key-padding mask, on a chosen path.
    ///
    /// A query whose every key is masked (a padding token on the left of a left-padded
    /// sequence) gets a zero context, never NaN.
    ///
    /// # Shapes
    /// - `input.x`: `[batch, seq, input_dim]`; `input.key_padding`: `[batch, seq]`
    /// - output: `[batch, seq, output_dim]`
    pub fn forward_with(&self, input: AttentionInput<B>) -> Result<Tensor<B, 3>, AttentionError> {
        let (x, key_padding, positions, path) = self.checked(input)?;
        let [batch, seq, _] = x.dims();
        let route = self.route(path, Call::Full);
        if route == Route::Explicit {
            check_explicit_size([batch, self.num_heads, seq, seq])?;
        }
        let context = match route {
            Route::CpuKernel | Route::GpuKernel => {
                let [q, k, v] = self.project_side_by_side(x, &positions);
                let context = kernels::attention(KernelInputs {
                    query: q,
                    key: k,
                    value: v,
                    heads: self.num_heads,
                    kv_heads: self.num_kv_heads,
                    window: self.sliding_window,
                    key_padding,
                    scores: self.score_rule(),
                });
                return Ok(projection::linear(&self.output_layer, context));
            }
            Route::Explicit => {
                let [q, k, v] = self.project(x, &positions, HeadLayout::Split);
                let mask = attend::mask_for(&q, 0, key_padding, self.sliding_window);
                let [k, v] = [k, v].map(|t| self.repeat_kv(t));
                attend::explicit(q, k, v, mask, &self.score_rule(), &self.dropout).context
            }
            Route::BurnOp => {
                let [q, k, v] = self.project(x, &positions, HeadLayout::Split);
                let [k, v] = [k, v].map(|t| self.repeat_kv(t));
                attend::fused(
                    q,
                    k,
                    v,
                    key_padding,
                    self.sliding_window,
                    &self.score_rule(),
                )
            }
        };
        Ok(self.merge_and_project(context))
    }

    /// The explicit forward pass, returning what the source chapter prints on the way: raw scores,
    /// masked scores and attention weights.
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, input_dim]`
    /// - output: see [`AttentionTrace`]
    pub fn forward_traced(&self, x: Tensor<B, 3>) -> Result<AttentionTrace<B>, AttentionError> {
        self.forward_traced_with(AttentionInput::new(x))
    }

    /// [`forward_traced`](Self::forward_traced) with a key-padding mask and positions (the
    /// input's path is ignored: the trace is the explicit path's).
    ///
    /// # Shapes
    /// - `input.x`: `[batch, seq, input_dim]`; mask and positions `[batch, seq]`
    /// - output: see [`AttentionTrace`]
    pub fn forward_traced_with(
        &self,
        input: AttentionInput<B>,
    ) -> Result<AttentionTrace<B>, AttentionError> {
        let (x, key_padding, positions, _) = self.checked(input)?;
        let [batch, seq, _] = x.dims();
        check_explicit_size([batch, self.num_heads, seq, seq])?;
        let [q, k, v] = self.project(x, &positions, HeadLayout::Split);
        let mask = attend::mask_for(&q, 0, key_padding, self.sliding_window);
        let [k, v] = [k, v].map(|t| self.repeat_kv(t));
        let AttentionScores {
            context,
            scores,
            masked_scores,
            weights,
        } = attend::explicit(q, k, v, mask, &self.score_rule(), &self.dropout);
        Ok(AttentionTrace {
            output: self.merge_and_project(context),
            scores,
            masked_scores,
            weights,
        })
    }

    /// An empty [`KvCache`] for this layer: up to `context_length` positions of its
    /// `num_kv_heads` heads, memory allocated as they come; with a sliding window it keeps only
    /// the positions a later query can still see.
    pub fn new_cache(&self) -> KvCache<B> {
        KvCache::new(self.num_kv_heads, self.head_dim, self.context_length)
            .with_window(self.sliding_window)
    }

    /// Incremental (autoregressive) attention: `x_new` holds the tokens that follow those already
    /// in `cache`; their keys and values are appended and each new token attends to every cached
    /// position and to the new ones up to itself. A prefill of many tokens and steps of one give
    /// the same outputs as one [`forward`](Self::forward) over the whole sequence.
    ///
    /// Errors (and leaves the cache as it was) when the cache would exceed `context_length`, when
    /// the batch size differs from the cache's, or when the cache belongs to another layer shape.
    ///
    /// # Shapes
    /// - `x_new`: `[batch, new, input_dim]`
    /// - output: `[batch, new, output_dim]`
    pub fn forward_cached(
        &self,
        x_new: Tensor<B, 3>,
        cache: &mut KvCache<B>,
    ) -> Result<Tensor<B, 3>, AttentionError> {
        self.forward_cached_with(AttentionInput::new(x_new), cache)
    }

    /// [`forward_cached`](Self::forward_cached) with a key-padding mask over the cached and new
    /// positions, explicit positions and a chosen path: `Explicit` masks the scores of the new
    /// queries against every cached key; `Fused` runs the backend's kernel over the cache in the
    /// kernel's own storage where it has one (ndarray, flex), else Burn's attention op (its causal
    /// mask is aligned bottom-right, which is what the cache needs) over the cache's tensors.
    ///
    /// # Shapes
    /// - `input.x`: `[batch, new, input_dim]`; `input.key_padding`: `[batch, cached + new]`;
    ///   `input.positions`: `[batch, new]`
    /// - output: `[batch, new, output_dim]`
    pub fn forward_cached_with(
        &self,
        input: AttentionInput<B>,
        cache: &mut KvCache<B>,
    ) -> Result<Tensor<B, 3>, AttentionError> {
        let AttentionInput {
            x: x_new,
            key_padding,
            positions,
            path,
        } = input;
        cache.check_layout(self.num_kv_heads, self.head_dim, self.context_length)?;
        self.check_input(&x_new, cache.len())?;
        let [batch, new, _] = x_new.dims();
        cache.check_batch(batch)?;
        let past = cache.len();
        check_shape(&key_padding, [batch, past + new], |expected, found| {
            AttentionError::PaddingShape { expected, found }
        })?;
        let positions = self.positions(positions, past, [batch, new])?;
        let plan = cache.plan(batch, new)?;
        let route = self.route(path, Call::Cached);
        if route == Route::Explicit {
            let keys = plan.keys_seen(new);
            check_explicit_size([batch, self.num_heads, new, keys])?;
        }
        // The cache keeps only the last positions: the padding of those this step sees.
        let seen_padding =
            |mask: Tensor<B, 2, Bool>, seen: usize| mask.narrow(1, past + new - seen, seen);
        if route.is_kernel() {
            let [q, k, v] = self.project_side_by_side(x_new, &positions);
            let (storage, seen) = cache.append(NewKv::SideBySide { keys: k, values: v }, plan);
            let key_padding = key_padding.map(|mask| seen_padding(mask, seen.len()));
            let context = kernels::cached_attention(CachedInputs {
                query: q,
                cache: storage,
                seen,
                heads: self.num_heads,
                window: self.sliding_window,
                key_padding,
                scores: self.score_rule(),
            });
            let output = projection::linear(&self.output_layer, context);
            cache.end_step()?;
            return Ok(output);
        }
        let [q, k, v] = self.project(x_new, &positions, HeadLayout::Split);
        let (storage, seen) = cache.append(NewKv::Split { keys: k, values: v }, plan);
        let (keys, values) = storage.tensors(seen.clone());
        let [keys, values] = [keys, values].map(|t| self.repeat_kv(t));
        let key_padding = key_padding.map(|mask| seen_padding(mask, seen.len()));
        let context = if route == Route::Explicit {
            let mask = attend::mask_for(&q, seen.len() - new, key_padding, self.sliding_window);
            attend::explicit(q, keys, values, mask, &self.score_rule(), &self.dropout).context
        } else {
            attend::fused(
                q,
                keys,
                values,
                key_padding,
                self.sliding_window,
                &self.score_rule(),
            )
        };
        let output = self.merge_and_project(context);
        cache.end_step()?;
        Ok(output)
    }

    /// Checks `x` against the layer: its width, a non-empty batch and sequence, and room in the
    /// context after `past` cached positions.
    pub fn check_input(&self, x: &Tensor<B, 3>, past: usize) -> Result<(), AttentionError> {
        let [batch, seq, features] = x.dims();
        if features != self.input_dim() {
            return Err(AttentionError::InputDim {
                expected: self.input_dim(),
                found: features,
            });
        }
        if batch == 0 {
            return Err(AttentionError::EmptyBatch);
        }
        if seq == 0 {
            return Err(AttentionError::EmptySequence);
        }
        if past + seq > self.context_length {
            return Err(AttentionError::ContextOverflow {
                seq: past + seq,
                context_length: self.context_length,
            });
        }
        Ok(())
    }

    /// What computes this call's attention core (see [`crate::route`]).
    fn route(&self, path: AttentionPath, call: Call) -> Route {
        let training = B::ad_enabled(&self.output_layer.weight.device());
        let dropout_active = training && self.dropout.prob > 0.0;
        route::<B>(path, call, training, dropout_active, self.sinks.is_some())
    }

    /// The scale, soft-cap and sinks every path computes the scores with.
    fn score_rule(&self) -> ScoreRule<B> {
        ScoreRule {
            scale: self.scale,
            softcap: self.softcap,
            sinks: self.sinks.as_ref().map(Param::val),
        }
    }

    /// A whole sequence's input, taken apart after checking it against the layer.
    #[allow(clippy::type_complexity)]
    fn checked(
        &self,
        input: AttentionInput<B>,
    ) -> Result<
        (
            Tensor<B, 3>,
            Option<Tensor<B, 2, Bool>>,
            Positions<B>,
            AttentionPath,
        ),
        AttentionError,
    > {
        let AttentionInput {
            x,
            key_padding,
            positions,
            path,
        } = input;
        self.check_input(&x, 0)?;
        let [batch, seq, _] = x.dims();
        check_shape(&key_padding, [batch, seq], |expected, found| {
            AttentionError::PaddingShape { expected, found }
        })?;
        let positions = self.positions(positions, 0, [batch, seq])?;
        Ok((x, key_padding, positions, path))
    }

    /// The rotary positions of a call's `[batch, seq]` tokens after `past` cached ones: the
    /// given ones, checked, or `past, past + 1, …`.
    fn positions(
        &self,
        given: Option<Tensor<B, 2, Int>>,
        past: usize,
        [batch, seq]: [usize; 2],
    ) -> Result<Positions<B>, AttentionError> {
        match given {
            Some(positions) if positions.dims() != [batch, seq] => {
                Err(AttentionError::PositionsShape {
                    expected: [batch, seq],
                    found: positions.dims(),
                })
            }
            Some(positions) => Ok(Positions::Given(positions)),
            None => Ok(Positions::From(past)),
        }
    }

    /// The one projection step of every path: queries, keys and values from `x`, queries and keys
    /// normalized (with q/k norms: over the projection's width before the head split, or per head
    /// after it) and then turned by their positions (with RoPE), each split into heads in `layout`
    /// as soon as it is made. Keys and values keep their `num_kv_heads` heads. Every attention
    /// core reads what this makes, so each variant here holds on every path.
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, input_dim]`
    /// - output: `[batch, seq, heads, head_dim]` ([`HeadLayout::SideBySide`]) or
    ///   `[batch, heads, seq, head_dim]` ([`HeadLayout::Split`]), with `num_heads` heads for the
    ///   queries and `num_kv_heads` for keys and values
    ///
    /// Splitting each projection as soon as it is made matters: projecting all three first and
    /// splitting afterwards gives wrong `output_layer` weight gradients on Burn 0.21's wgpu
    /// (fusion) backend for a one-token sequence (`tests/layer/parity.rs`, `book_s0_b1_t1_i4_o4_h1_bias`).
    fn project(
        &self,
        x: Tensor<B, 3>,
        positions: &Positions<B>,
        layout: HeadLayout,
    ) -> [Tensor<B, 4>; 3] {
        let [batch, seq, _] = x.dims();
        // One set of angles for the queries and the keys.
        let angles = self.rotary.as_ref().map(|rotary| {
            (
                rotary,
                rotary.angles(positions, seq, x.dtype(), &x.device()),
            )
        });
        let scope = self.qk_norm.as_ref().map(|config| config.scope);
        let layers = [
            (
                &self.query_layer,
                self.num_heads,
                self.query_norm.as_ref(),
                angles.as_ref(),
            ),
            (
                &self.key_layer,
                self.num_kv_heads,
                self.key_norm.as_ref(),
                angles.as_ref(),
            ),
            (&self.value_layer, self.num_kv_heads, None, None),
        ];
        // On a bare CPU backend the three products are one call; elsewhere each is made when
        // its turn comes (see above).
        let mut on_host = projection::linears_on_host(layers.map(|(layer, ..)| layer), &x)
            .map(IntoIterator::into_iter);
        layers.map(|(layer, heads, norm, angles)| {
            let norm_at = |at: QkNormScope| norm.filter(|_| scope == Some(at));
            // [batch, seq, heads · head_dim]
            let projected = match on_host.as_mut().and_then(Iterator::next) {
                Some(projected) => projected,
                None => projection::linear(layer, x.clone()),
            };
            let projected = match norm_at(QkNormScope::Width) {
                Some(norm) => norm.forward(projected),
                None => projected,
            };
            let side_by_side = projected.reshape([batch, seq, heads, self.head_dim]);
            let side_by_side = match norm_at(QkNormScope::Head) {
                Some(norm) => norm.forward(side_by_side),
                None => side_by_side,
            };
            let side_by_side = match angles {
                Some((rotary, angles)) => rotary.apply(side_by_side, angles),
                None => side_by_side,
            };
            match layout {
                HeadLayout::SideBySide => side_by_side,
                // `view(b, t, h, hd).transpose(1, 2)`: head `j` owns features `[j·hd, (j+1)·hd)`.
                HeadLayout::Split => side_by_side.swap_dims(1, 2),
            }
        })
    }

    /// [`project`](Self::project) for a kernel: the heads side by side in one feature dimension,
    /// as the projections made them.
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, input_dim]`
    /// - output: `[batch, seq, heads · head_dim]`, with `num_heads` heads for the queries and
    ///   `num_kv_heads` for keys and values
    fn project_side_by_side(&self, x: Tensor<B, 3>, positions: &Positions<B>) -> [Tensor<B, 3>; 3] {
        self.project(x, positions, HeadLayout::SideBySide).map(|t| {
            let [batch, seq, heads, head_dim] = t.dims();
            t.reshape([batch, seq, heads * head_dim])
        })
    }

    /// Each key/value head repeated for the query heads of its group (Hugging Face's
    /// `repeat_kv`), for the paths whose attention needs equal head counts.
    ///
    /// # Shapes
    /// - `x`: `[batch, kv_heads, keys, head_dim]`
    /// - output: `[batch, heads, keys, head_dim]`
    fn repeat_kv(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let group = self.num_heads / self.num_kv_heads;
        if group == 1 {
            return x;
        }
        let [batch, kv_heads, keys, head_dim] = x.dims();
        x.reshape([batch, kv_heads, 1, keys, head_dim])
            .expand([batch, kv_heads, group, keys, head_dim])
            .reshape([batch, kv_heads * group, keys, head_dim])
    }

    /// Merges the heads' contexts and applies the output projection.
    ///
    /// # Shapes
    /// - `context`: `[batch, heads, seq, head_dim]`
    /// - output: `[batch, seq, output_dim]`
    fn merge_and_project(&self, context: Tensor<B, 4>) -> Tensor<B, 3> {
        projection::linear(&self.output_layer, merge_heads(context))
    }
}

/// The largest `[batch, heads, queries, keys]` tensor, in bytes (as `f32`), that the explicit
/// path materializes; it holds several at once (scores, masked scores, weights, the mask). Larger
/// requests are refused with [`AttentionError::ExplicitTooLarge`] instead of exhausting memory:
/// the fused path computes the same result in `O(seq)` memory.
pub const EXPLICIT_SCORES_LIMIT: usize = 4 << 30;

/// `Err(error(expected, found))` when `tensor` is given and its shape is not `expected`.
fn check_shape<B: Backend>(
    tensor: &Option<Tensor<B, 2, Bool>>,
    expected: [usize; 2],
    error: impl FnOnce([usize; 2], [usize; 2]) -> AttentionError,
) -> Result<(), AttentionError> {
    match tensor {
        Some(tensor) if tensor.dims() != expected => Err(error(expected, tensor.dims())),
        _ => Ok(()),
    }
}

/// Refuses explicit attention over `[batch, heads, queries, keys]` scores larger than
/// [`EXPLICIT_SCORES_LIMIT`].
fn check_explicit_size(shape: [usize; 4]) -> Result<(), AttentionError> {
    let bytes = shape
        .iter()
        .try_fold(4usize, |bytes, &n| bytes.checked_mul(n));
    match bytes {
        Some(bytes) if bytes <= EXPLICIT_SCORES_LIMIT => Ok(()),
        _ => Err(AttentionError::ExplicitTooLarge {
            shape,
            gib: shape.iter().map(|&n| n as f64).product::<f64>() * 4.0 / (1u64 << 30) as f64,
        }),
    }
}

/// How [`MultiHeadAttention::project`] lays out the heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeadLayout {
    /// `[batch, seq, heads, head_dim]`: the projection's memory as it is (the CPU kernel's).
    SideBySide,
    /// `[batch, heads, seq, head_dim]`: PyTorch's `transpose(1, 2)` (the tensor ops' layout).
    Split,
}

/// The inverse of the head split: `transpose(1, 2).reshape(b, t, h·hd)`.
///
/// # Shapes
/// - `x`: `[batch, heads, seq, head_dim]`
/// - output: `[batch, seq, heads · head_dim]`
fn merge_heads<B: Backend>(x: Tensor<B, 4>) -> Tensor<B, 3> {
    let [batch, heads, seq, head_dim] = x.dims();
    x.swap_dims(1, 2).reshape([batch, seq, heads * head_dim])
}
