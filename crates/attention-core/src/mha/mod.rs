//! The layer: [`MultiHeadAttention`], its accessors and forward entry points, and the checks
//! of their input.
//!
//! - this file: the module, its accessors and forward entry points, the input checks
//! - `config.rs`: [`MultiHeadAttentionConfig`], its validation and `init`
//! - `input.rs`: [`AttentionInput`] and [`AttentionTrace`], what a forward pass takes and shows
//! - `paged.rs`: the layer on a ragged step over a page pool
//! - `project.rs`: the projections in and out, the heads split and merged

use burn::module::Param;
use burn::nn::{Dropout, DropoutConfig, Linear, LinearConfig};
use burn::prelude::*;
use burn::tensor::{Bool, Int};

use crate::attend::{self, AttentionPath, AttentionScores};
use crate::cache::KvCache;
use crate::documents::Documents;
use crate::error::AttentionError;
use crate::heads::merge_heads;
use crate::kernels::{self, CachedInputs, KernelInputs, NewKv};
use crate::qk_norm::{QkNorm, QkNormConfig, QkNormScope};
use crate::rope::{Positions, RopeConfig, Rotary};
use crate::route::{Call, Route, route};
use crate::score_rule::ScoreRule;
use cpu_linalg::projection::{self, PackedWeightsCache};

mod config;
mod input;
mod paged;
mod project;
#[cfg(test)]
mod tests;

pub use config::MultiHeadAttentionConfig;
pub use input::{AttentionInput, AttentionTrace};
use project::HeadLayout;

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
    /// The query, key and value weights packed side by side for the CPU products.
    #[module(skip)]
    packed_inputs: PackedWeightsCache,
    /// The output projection's weight packed for the CPU products.
    #[module(skip)]
    packed_output: PackedWeightsCache,
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

    /// Causal self-attention over `input`: a tensor `x`, or an [`AttentionInput`] with a
    /// key-padding mask, positions or a path.
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, input_dim]` with `1 ≤ seq ≤ context_length`
    /// - output: `[batch, seq, output_dim]`
    ///
    /// # Panics
    /// With the message of [`try_forward`](Self::try_forward)'s error.
    pub fn forward(&self, input: impl Into<AttentionInput<B>>) -> Tensor<B, 3> {
        self.try_forward(input)
            .unwrap_or_else(|error| panic!("{error}"))
    }

    /// Causal self-attention over `input` (a tensor `x` or an [`AttentionInput`]), or the
    /// reason it does not fit the layer.
    ///
    /// A tensor takes [`AttentionPath::Auto`]: the fused path, except under autodiff with active
    /// dropout or on a backend without a fused backward of this crate's (see
    /// [`AttentionPath::Auto`]). A query whose every key is masked (a padding token on the left
    /// of a left-padded sequence) gets a zero context, never NaN.
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, input_dim]` with `1 ≤ seq ≤ context_length`; a key-padding mask and
    ///   positions `[batch, seq]`
    /// - output: `[batch, seq, output_dim]`
    pub fn try_forward(
        &self,
        input: impl Into<AttentionInput<B>>,
    ) -> Result<Tensor<B, 3>, AttentionError> {
        let Checked {
            x,
            key_padding,
            positions,
            documents,
            path,
        } = self.checked(input.into())?;
        let [batch, seq, _] = x.dims();
        let route = self.route(path, Call::Full);
        if route == Route::Explicit {
            check_explicit_size([batch, self.num_heads, seq, seq])?;
        }
        // [batch, seq, heads · head_dim]
        let context = match route {
            Route::CpuKernel | Route::GpuKernel => {
                let [q, k, v] = self.project_side_by_side(x, &positions);
                kernels::attention(KernelInputs {
                    query: q,
                    key: k,
                    value: v,
                    heads: self.num_heads,
                    kv_heads: self.num_kv_heads,
                    window: self.sliding_window,
                    key_padding,
                    documents,
                    scores: self.score_rule(),
                })
            }
            Route::Explicit => {
                let [q, k, v] = self.project(x, &positions, HeadLayout::Split);
                let mask =
                    attend::mask_for(&q, 0, key_padding, self.sliding_window, documents.as_ref());
                let [k, v] = [k, v].map(|t| self.repeat_kv(t));
                let scores = attend::explicit(q, k, v, mask, &self.score_rule(), &self.dropout);
                merge_heads(scores.context)
            }
            Route::BurnOp => {
                let [q, k, v] = self.project(x, &positions, HeadLayout::Split);
                let [k, v] = [k, v].map(|t| self.repeat_kv(t));
                let context = attend::fused(
                    q,
                    k,
                    v,
                    key_padding,
                    self.sliding_window,
                    documents.as_ref(),
                    &self.score_rule(),
                );
                merge_heads(context)
            }
        };
        Ok(self.project_output(context))
    }

    /// The explicit forward pass, returning what the source chapter prints on the way: raw scores,
    /// masked scores and attention weights. `input` is a tensor or an [`AttentionInput`] (whose
    /// path is ignored: the trace is the explicit path's).
    ///
    /// # Shapes
    /// - `x`: `[batch, seq, input_dim]`; a key-padding mask and positions `[batch, seq]`
    /// - output: see [`AttentionTrace`]
    pub fn forward_traced(
        &self,
        input: impl Into<AttentionInput<B>>,
    ) -> Result<AttentionTrace<B>, AttentionError> {
        let Checked {
            x,
            key_padding,
            positions,
            documents,
            ..
        } = self.checked(input.into())?;
        let [batch, seq, _] = x.dims();
        check_explicit_size([batch, self.num_heads, seq, seq])?;
        let [q, k, v] = self.project(x, &positions, HeadLayout::Split);
        let mask = attend::mask_for(&q, 0, key_padding, self.sliding_window, documents.as_ref());
        let [k, v] = [k, v].map(|t| self.repeat_kv(t));
        let AttentionScores {
            context,
            scores,
            masked_scores,
            weights,
        } = attend::explicit(q, k, v, mask, &self.score_rule(), &self.dropout);
        Ok(AttentionTrace {
            output: self.project_output(merge_heads(context)),
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

    /// Incremental (autoregressive) attention: `input` (a tensor `x_new` or an
    /// [`AttentionInput`]) holds the tokens that follow those already in `cache`; their keys and
    /// values are appended and each new token attends to every cached position and to the new
    /// ones up to itself. A prefill of many tokens and steps of one give the same outputs as one
    /// [`forward`](Self::forward) over the whole sequence.
    ///
    /// An input's key-padding mask covers the cached and the new positions; on the `Explicit`
    /// path the new queries' scores against every cached key are masked; `Fused` runs the
    /// backend's kernel over the cache in the kernel's own storage where it has one (ndarray,
    /// flex), else Burn's attention op (its causal mask is aligned bottom-right, which is what
    /// the cache needs) over the cache's tensors.
    ///
    /// Errors (and leaves the cache as it was) when the cache would exceed `context_length`, when
    /// the batch size differs from the cache's, or when the cache belongs to another layer shape.
    ///
    /// # Shapes
    /// - `x_new`: `[batch, new, input_dim]`; a key-padding mask `[batch, cached + new]`;
    ///   positions `[batch, new]`
    /// - output: `[batch, new, output_dim]`
    pub fn forward_cached(
        &self,
        input: impl Into<AttentionInput<B>>,
        cache: &mut KvCache<B>,
    ) -> Result<Tensor<B, 3>, AttentionError> {
        let AttentionInput {
            x: x_new,
            key_padding,
            positions,
            documents,
            path,
        } = input.into();
        if documents.is_some() {
            return Err(AttentionError::DocumentsWithCache);
        }
        cache.check_layout(self.num_kv_heads, self.head_dim, self.context_length)?;
        self.check_input(&x_new, cache.len())?;
        let [batch, new, _] = x_new.dims();
        cache.check_batch(batch)?;
        let past = cache.len();
        check_shape(&key_padding, [batch, past + new], |expected, found| {
            AttentionError::PaddingShape { expected, found }
        })?;
        let positions = self.positions(positions, past, [batch, new], None)?;
        let plan = cache.plan(batch, new)?;
        let route = self.route(path, Call::Cached);
        if route == Route::Explicit {
            let keys = plan.keys_seen(new);
            check_explicit_size([batch, self.num_heads, new, keys])?;
        }
        // The cache keeps only the last positions: the padding of those this step sees.
        let seen_padding =
            |mask: Tensor<B, 2, Bool>, seen: usize| mask.narrow(1, past + new - seen, seen);
        // [batch, new, heads · head_dim]
        let context = if route.is_kernel() {
            let [q, k, v] = self.project_side_by_side(x_new, &positions);
            let (storage, seen) = cache.append(NewKv::SideBySide { keys: k, values: v }, plan)?;
            let key_padding = key_padding.map(|mask| seen_padding(mask, seen.len()));
            kernels::cached_attention(CachedInputs {
                query: q,
                cache: storage,
                seen,
                heads: self.num_heads,
                window: self.sliding_window,
                key_padding,
                scores: self.score_rule(),
            })
        } else {
            let [q, k, v] = self.project(x_new, &positions, HeadLayout::Split);
            let (storage, seen) = cache.append(NewKv::Split { keys: k, values: v }, plan)?;
            let (keys, values) = storage.tensors(seen.clone());
            let [keys, values] = [keys, values].map(|t| self.repeat_kv(t));
            let key_padding = key_padding.map(|mask| seen_padding(mask, seen.len()));
            let context = if route == Route::Explicit {
                let past_seen = seen.len() - new;
                let mask = attend::mask_for(&q, past_seen, key_padding, self.sliding_window, None);
                attend::explicit(q, keys, values, mask, &self.score_rule(), &self.dropout).context
            } else {
                attend::fused(
                    q,
                    keys,
                    values,
                    key_padding,
                    self.sliding_window,
                    None,
                    &self.score_rule(),
                )
            };
            merge_heads(context)
        };
        let output = self.project_output(context);
        cache.end_step()?;
        Ok(output)
    }

    /// Checks `x` against the layer: its width, a non-empty batch and sequence, and room in the
    /// context after `past` cached positions.
    fn check_input(&self, x: &Tensor<B, 3>, past: usize) -> Result<(), AttentionError> {
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
    fn checked(&self, input: AttentionInput<B>) -> Result<Checked<B>, AttentionError> {
        let AttentionInput {
            x,
            key_padding,
            positions,
            documents,
            path,
        } = input;
        self.check_input(&x, 0)?;
        let [batch, seq, _] = x.dims();
        check_shape(&key_padding, [batch, seq], |expected, found| {
            AttentionError::PaddingShape { expected, found }
        })?;
        if let Some(documents) = &documents {
            // Reading the padding costs a sync on a GPU: only when both are given.
            let padding: Option<Vec<bool>> = key_padding
                .as_ref()
                .map(|mask| mask.to_data().iter::<bool>().collect());
            documents.check([batch, seq], padding.as_deref())?;
        }
        // Rows of one document each are what the call is without documents.
        let documents = documents.filter(|documents| !documents.is_whole_rows());
        let positions = self.positions(positions, 0, [batch, seq], documents.as_ref())?;
        Ok(Checked {
            x,
            key_padding,
            positions,
            documents,
            path,
        })
    }

    /// The rotary positions of a call's `[batch, seq]` tokens after `past` cached ones: the
    /// given ones, checked; each document's from 0 in rows packed from `documents`; or `past,
    /// past + 1, …`.
    fn positions(
        &self,
        given: Option<Tensor<B, 2, Int>>,
        past: usize,
        [batch, seq]: [usize; 2],
        documents: Option<&Documents>,
    ) -> Result<Positions<B>, AttentionError> {
        match given {
            Some(positions) if positions.dims() != [batch, seq] => {
                Err(AttentionError::PositionsShape {
                    expected: [batch, seq],
                    found: positions.dims(),
                })
            }
            Some(positions) => Ok(Positions::Given(positions)),
            None => match documents {
                Some(documents) if self.rotary.is_some() => Ok(Positions::Given(
                    documents.position_tensor(&self.output_layer.weight.device()),
                )),
                _ => Ok(Positions::From(past)),
            },
        }
    }
}

/// A whole sequence's input, checked against the layer ([`MultiHeadAttention::checked`]).
struct Checked<B: Backend> {
    x: Tensor<B, 3>,
    key_padding: Option<Tensor<B, 2, Bool>>,
    positions: Positions<B>,
    /// `None` where every row is one document.
    documents: Option<Documents>,
    path: AttentionPath,
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
