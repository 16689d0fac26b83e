//! The attention core alone ([`causal_attention`]), for a model that makes its own projections:
//! a kernel of this crate's where the backend has one, Burn's op elsewhere.

use burn::prelude::*;

use crate::attend;
use crate::documents::Documents;
use crate::error::AttentionError;
use crate::heads::{merge_heads, repeat_kv, split_heads};
use crate::kernels::{self, Kernel, KernelInputs};
use crate::score_rule::ScoreRule;

/// Causal attention of `query` over `key` and `value` as projections make them, the heads side
/// by side: `softmax(q kᵀ / √head_dim) v` per head, query `i` seeing the keys up to position
/// `i + keys − queries`; query head `h` reads key/value head `h / (heads / kv_heads)` (grouped
/// heads); with a `window`, query position `p` sees only keys `j` with `p − j < window`; with
/// `documents` (rows packed from several, `queries == keys`), only the keys of its own document.
/// The layer's attention core alone, for a model that makes its own projections.
///
/// On a backend with a kernel of this crate's own ([`Kernel::of`]) the kernel computes it, with
/// its own backward under `Autodiff`; elsewhere Burn's fused attention op does, on the heads
/// split apart.
///
/// # Shapes
/// - `query`: `[batch, queries, heads · head_dim]`
/// - `key`, `value`: `[batch, keys, kv_heads · head_dim]`, `keys ≥ queries`
/// - output: `[batch, queries, heads · head_dim]`
///
/// # Errors
/// [`AttentionError::CoreShapes`] when the shapes do not fit together,
/// [`AttentionError::ZeroSize`] for zero heads or a window of zero keys, and
/// [`AttentionError::DocumentsShape`] when `documents` are not `[batch, queries]` or the queries
/// follow cached keys.
///
/// ```
/// use attention_core::causal_attention;
/// use burn::backend::NdArray;
/// use burn::prelude::*;
///
/// let device = Default::default();
/// let q = Tensor::<NdArray, 3>::ones([1, 5, 8], &device);
/// let kv = Tensor::<NdArray, 3>::ones([1, 5, 4], &device);
/// // 2 query heads of 4 features over 1 key/value head.
/// let context = causal_attention(q, kv.clone(), kv, 2, None, None).unwrap();
/// assert_eq!(context.dims(), [1, 5, 8]);
/// ```
pub fn causal_attention<B: Backend>(
    query: Tensor<B, 3>,
    key: Tensor<B, 3>,
    value: Tensor<B, 3>,
    heads: usize,
    window: Option<usize>,
    documents: Option<&Documents>,
) -> Result<Tensor<B, 3>, AttentionError> {
    if heads == 0 {
        return Err(AttentionError::ZeroSize { name: "heads" });
    }
    if window == Some(0) {
        return Err(AttentionError::ZeroSize { name: "window" });
    }
    let [batch, queries, width] = query.dims();
    let [key_batch, keys, kv_width] = key.dims();
    let shapes_fit = width.is_multiple_of(heads)
        && width > 0
        && kv_width.is_multiple_of(width / heads)
        && kv_width > 0
        && heads.is_multiple_of(kv_width / (width / heads))
        && key_batch == batch
        && value.dims() == key.dims()
        && keys >= queries
        && queries > 0;
    if !shapes_fit {
        return Err(AttentionError::CoreShapes {
            query: query.dims(),
            key: key.dims(),
            value: value.dims(),
            heads,
        });
    }
    if let Some(documents) = documents {
        documents.check_shape([batch, keys])?;
        if keys != queries {
            return Err(AttentionError::DocumentsShape {
                expected: [batch, queries],
                found: documents.shape(),
            });
        }
    }
    let documents = documents.filter(|documents| !documents.is_whole_rows());
    let head_dim = width / heads;
    let kv_heads = kv_width / head_dim;
    let rule = ScoreRule {
        scale: None,
        softcap: None,
        sinks: None,
    };
    if Kernel::of::<B>().is_some() {
        return Ok(kernels::attention(KernelInputs {
            query,
            key,
            value,
            heads,
            kv_heads,
            window,
            key_padding: None,
            documents: documents.cloned(),
            scores: rule,
        }));
    }
    let group = heads / kv_heads;
    let [key, value] = [key, value].map(|t| repeat_kv(split_heads(t, kv_heads), group));
    let query = split_heads(query, heads);
    let context = attend::fused(query, key, value, None, window, documents, &rule);
    Ok(merge_heads(context))
}
