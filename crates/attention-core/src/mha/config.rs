//! [`MultiHeadAttentionConfig`]: the layer's shape and variants, checked before a module is made.

use super::*;

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
            packed_inputs: PackedWeightsCache::default(),
            packed_output: PackedWeightsCache::default(),
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
