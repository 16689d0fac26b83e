//! The layer: [`MultiHeadAttentionConfig`] and [`MultiHeadAttention`].

use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::Bool;

use crate::attend::{self, AttentionPath, AttentionScores};
use crate::cache::KvCache;
use crate::error::AttentionError;
use crate::flash::{self, FlashInputs};
use crate::route::{Call, Route, route};

/// Configuration of a causal [`MultiHeadAttention`] layer, with the parameter names of the source
/// chapter's `MultiHeadAttention(input_dim, output_dim, context_length, dropout, num_heads,
/// qkv_bias)`.
#[derive(Config, Debug)]
pub struct MultiHeadAttentionConfig {
    /// Features of each input token.
    pub input_dim: usize,
    /// Features of each output token; split into `num_heads` heads of `output_dim / num_heads`.
    pub output_dim: usize,
    /// The longest sequence the layer accepts (and the capacity of its [`KvCache`]).
    pub context_length: usize,
    /// Number of attention heads; must divide `output_dim`.
    pub num_heads: usize,
    /// Dropout probability on the attention weights, applied after the softmax. Default: `0.0`.
    /// Active only on an autodiff backend, as Burn's [`Dropout`] is.
    #[config(default = 0.0)]
    pub dropout: f64,
    /// Whether the query, key and value projections have a bias. Default: `false`.
    /// The output projection always has one.
    #[config(default = false)]
    pub qkv_bias: bool,
}

impl MultiHeadAttentionConfig {
    /// Checks the config: every size at least 1, `num_heads` divides `output_dim`, `dropout` in
    /// `[0, 1)`.
    pub fn validate(&self) -> Result<(), AttentionError> {
        for (name, value) in [
            ("input_dim", self.input_dim),
            ("output_dim", self.output_dim),
            ("context_length", self.context_length),
            ("num_heads", self.num_heads),
        ] {
            if value == 0 {
                return Err(AttentionError::ZeroSize { name });
            }
        }
        if !self.output_dim.is_multiple_of(self.num_heads) {
            return Err(AttentionError::HeadsDoNotDivide {
                output_dim: self.output_dim,
                num_heads: self.num_heads,
            });
        }
        // Written so that NaN fails too.
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(AttentionError::DropoutOutOfRange(self.dropout));
        }
        Ok(())
    }

    /// Width of one head: `output_dim / num_heads`.
    pub fn head_dim(&self) -> usize {
        self.output_dim / self.num_heads
    }

    /// Initializes a layer with PyTorch's default `nn.Linear` initialization
    /// (`U(-1/√fan_in, 1/√fan_in)`), or says what is wrong with the config.
    pub fn try_init<B: Backend>(
        &self,
        device: &B::Device,
    ) -> Result<MultiHeadAttention<B>, AttentionError> {
        self.validate()?;
        let projection = |bias| {
            LinearConfig::new(self.input_dim, self.output_dim)
                .with_bias(bias)
                .init(device)
        };
        Ok(MultiHeadAttention {
            query_layer: projection(self.qkv_bias),
            key_layer: projection(self.qkv_bias),
            value_layer: projection(self.qkv_bias),
            output_layer: LinearConfig::new(self.output_dim, self.output_dim).init(device),
            dropout: DropoutConfig::new(self.dropout).init(),
            num_heads: self.num_heads,
            context_length: self.context_length,
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

/// Causal multi-head self-attention, as in GPT.
///
/// `y = output_layer(merge_heads(dropout(softmax(mask(q kᵀ) / √head_dim)) v))` with
/// `q, k, v = query_layer(x), key_layer(x), value_layer(x)` split into heads; head `j` owns
/// features `[j·head_dim, (j+1)·head_dim)`. The field names are the keys of the reference's
/// PyTorch `state_dict`, so weights map one to one (see [`crate::weights`]).
///
/// Burn's [`Linear`] stores its weight as `[in, out]`, the transpose of PyTorch's `nn.Linear`.
#[derive(Module, Debug)]
pub struct MultiHeadAttention<B: Backend> {
    /// Query projection, `input_dim → output_dim`.
    pub query_layer: Linear<B>,
    /// Key projection, `input_dim → output_dim`.
    pub key_layer: Linear<B>,
    /// Value projection, `input_dim → output_dim`.
    pub value_layer: Linear<B>,
    /// Output projection, `output_dim → output_dim`, with bias.
    pub output_layer: Linear<B>,
    /// Dropout on the attention weights (after the softmax).
    pub dropout: Dropout,
    num_heads: usize,
    context_length: usize,
}

/// A forward pass's input beyond the tokens: an optional key-padding mask and the path to take.
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
    path: AttentionPath,
}

impl<B: Backend> AttentionInput<B> {
    /// Tokens `x` of shape `[batch, seq, input_dim]`, no padding, [`AttentionPath::Auto`].
    pub fn new(x: Tensor<B, 3>) -> Self {
        Self {
            x,
            key_padding: None,
            path: AttentionPath::Auto,
        }
    }

    /// Marks padding tokens, which no query attends to.
    ///
    /// # Shapes
    /// - `mask`: `[batch, seq]`, `true` = padding
    pub fn key_padding(mut self, mask: Tensor<B, 2, Bool>) -> Self {
        self.key_padding = Some(mask);
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
        self.output_dim() / self.num_heads
    }

    /// The config this layer answers to (its sizes, dropout and whether it has a QKV bias).
    pub fn config(&self) -> MultiHeadAttentionConfig {
        MultiHeadAttentionConfig::new(
            self.input_dim(),
            self.output_dim(),
            self.context_length,
            self.num_heads,
        )
        .with_dropout(self.dropout.prob)
        .with_qkv_bias(self.query_layer.bias.is_some())
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
        let AttentionInput {
            x,
            key_padding,
            path,
        } = input;
        self.check_input(&x, 0)?;
        if let Some(mask) = &key_padding {
            let [batch, seq, _] = x.dims();
            if mask.dims() != [batch, seq] {
                return Err(AttentionError::PaddingShape {
                    expected: [batch, seq],
                    found: mask.dims(),
                });
            }
        }
        let route = self.route(path, Call::Full);
        if route == Route::Explicit {
            let [batch, seq, _] = x.dims();
            check_explicit_size([batch, self.num_heads, seq, seq])?;
        }
        let context = match route {
            Route::CpuKernel => {
                let [batch, seq, _] = x.dims();
                let width = self.num_heads * self.head_dim();
                let [q, k, v] = self
                    .project(x, HeadLayout::SideBySide)
                    .map(|t| t.reshape([batch, seq, width]));
                let context = flash::causal_attention(FlashInputs {
                    query: q,
                    key: k,
                    value: v,
                    heads: self.num_heads,
                    key_padding,
                });
                return Ok(self.output_layer.forward(context));
            }
            Route::Explicit => {
                let [q, k, v] = self.project(x, HeadLayout::Split);
                let mask = attend::mask_for(&q, 0, key_padding);
                attend::explicit(q, k, v, mask, &self.dropout).context
            }
            Route::BurnOp => {
                let [q, k, v] = self.project(x, HeadLayout::Split);
                attend::fused(q, k, v, key_padding)
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
        self.check_input(&x, 0)?;
        let [batch, seq, _] = x.dims();
        check_explicit_size([batch, self.num_heads, seq, seq])?;
        let [q, k, v] = self.project(x, HeadLayout::Split);
        let mask = attend::mask_for(&q, 0, None);
        let AttentionScores {
            context,
            scores,
            masked_scores,
            weights,
        } = attend::explicit(q, k, v, mask, &self.dropout);
        Ok(AttentionTrace {
            output: self.merge_and_project(context),
            scores,
            masked_scores,
            weights,
        })
    }

    /// An empty [`KvCache`] for this layer: up to `context_length` positions, memory allocated as
    /// they come.
    pub fn new_cache(&self) -> KvCache<B> {
        KvCache::new(self.num_heads, self.head_dim(), self.context_length)
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
        self.forward_cached_with(x_new, cache, AttentionPath::Auto)
    }

    /// [`forward_cached`](Self::forward_cached) on a chosen path: `Explicit` masks the scores of
    /// the new queries against every cached key, `Fused` calls Burn's attention op (its causal
    /// mask is aligned bottom-right, which is what the cache needs; the CPU kernel is not used
    /// here, as the cache's keys are stored per head).
    ///
    /// # Shapes
    /// - `x_new`: `[batch, new, input_dim]`
    /// - output: `[batch, new, output_dim]`
    pub fn forward_cached_with(
        &self,
        x_new: Tensor<B, 3>,
        cache: &mut KvCache<B>,
        path: AttentionPath,
    ) -> Result<Tensor<B, 3>, AttentionError> {
        cache.check_layout(self.num_heads, self.head_dim(), self.context_length)?;
        self.check_input(&x_new, cache.len())?;
        let [batch, new, _] = x_new.dims();
        cache.check_batch(batch)?;
        let allocate = cache.plan(batch, new)?;
        let past = cache.len();
        let route = self.route(path, Call::Cached);
        if route == Route::Explicit {
            check_explicit_size([batch, self.num_heads, new, past + new])?;
        }
        let [q, k, v] = self.project(x_new, HeadLayout::Split);
        let (keys, values) = cache.append(k, v, allocate);
        let context = match route {
            Route::Explicit => {
                let mask = attend::mask_for(&q, past, None);
                attend::explicit(q, keys, values, mask, &self.dropout).context
            }
            Route::BurnOp | Route::CpuKernel => attend::fused(q, keys, values, None),
        };
        let output = self.merge_and_project(context);
        // Burn 0.21's lazy wgpu (fusion) backend lets work of the next step overtake this step's
        // reads of the cache storage, which the next step writes in place: decoding then reads
        // wrong keys (tested by `cached_decoding_reproduces_the_fixtures`). Running this step's
        // queue first costs one sync per step there; it is a no-op on the eager CPU backends.
        B::sync(&output.device()).expect("the device runs");
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
        route::<B>(path, call, training, training && self.dropout.prob > 0.0)
    }

    /// The one projection step of every path: queries, keys and values from `x`, each split into
    /// heads in `layout` as soon as it is made.
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, input_dim]`
    /// - output: three `[batch, seq, heads, head_dim]` ([`HeadLayout::SideBySide`]) or
    ///   `[batch, heads, seq, head_dim]` ([`HeadLayout::Split`])
    ///
    /// Splitting each projection as soon as it is made matters: projecting all three first and
    /// splitting afterwards gives wrong `output_layer` weight gradients on Burn 0.21's wgpu
    /// (fusion) backend for a one-token sequence (`parity.rs`, `book_s0_b1_t1_i4_o4_h1_bias`).
    fn project(&self, x: Tensor<B, 3>, layout: HeadLayout) -> [Tensor<B, 4>; 3] {
        let [batch, seq, _] = x.dims();
        let (heads, head_dim) = (self.num_heads, self.head_dim());
        [&self.query_layer, &self.key_layer, &self.value_layer].map(|layer| {
            let side_by_side = layer
                .forward(x.clone())
                .reshape([batch, seq, heads, head_dim]);
            match layout {
                HeadLayout::SideBySide => side_by_side,
                // `view(b, t, h, hd).transpose(1, 2)`: head `j` owns features `[j·hd, (j+1)·hd)`.
                HeadLayout::Split => side_by_side.swap_dims(1, 2),
            }
        })
    }

    /// Merges the heads' contexts and applies the output projection.
    ///
    /// # Shapes
    /// - `context`: `[batch, heads, seq, head_dim]`
    /// - output: `[batch, seq, output_dim]`
    fn merge_and_project(&self, context: Tensor<B, 4>) -> Tensor<B, 3> {
        self.output_layer.forward(merge_heads(context))
    }
}

/// The largest `[batch, heads, queries, keys]` tensor, in bytes (as `f32`), that the explicit
/// path materializes; it holds several at once (scores, masked scores, weights, the mask). Larger
/// requests are refused with [`AttentionError::ExplicitTooLarge`] instead of exhausting memory:
/// the fused path computes the same result in `O(seq)` memory.
pub const EXPLICIT_SCORES_LIMIT: usize = 4 << 30;

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
