//! What a key/value cache stores its keys and values in.

use std::fmt;
use std::str::FromStr;

/// The element type of a key/value cache ([`KvCache`](crate::KvCache), or a page pool's
/// [`LayerPages`](crate::LayerPages)), chosen where the cache is made
/// ([`KvCache::with_kv_dtype`](crate::KvCache::with_kv_dtype),
/// [`PagePool::with_kv_dtype`](crate::PagePool::with_kv_dtype)).
///
/// A narrower type stores each cached position in fewer bytes, which a decoding step — reading
/// every cached key and value once — reads in less time. The keys and values of a step are
/// rounded once, when they are written; the kernels read them in place and compute in the
/// model's float type (`f32` on the CPU): the CPU kernel (ndarray, burn-flex) reads every type,
/// the GPU kernel (wgpu, CUDA) f16 (on devices with f16) and int8. Elsewhere (a bf16 cache on
/// the GPU, the explicit path, `Autodiff`) a narrow cache is
/// [`AttentionError::KvDtypeUnsupported`](crate::AttentionError::KvDtypeUnsupported).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvDtype {
    /// The layer's own float type: exactly today's cache, bit for bit.
    #[default]
    Model,
    /// IEEE half precision: half of `f32`'s bytes. Finite values beyond ±65 504 are saturated to
    /// ±65 504; infinities and NaN are kept (and give what they give with an `f32` cache).
    F16,
    /// bfloat16: half of `f32`'s bytes, `f32`'s range with 8 bits of mantissa (the CPU kernel
    /// only).
    Bf16,
    /// Symmetric int8 with one `f32` scale per position and key/value head (`max |x| / 127`,
    /// vLLM's per-token-head int8): a quarter of `f32`'s bytes plus the scale. A row of zeros
    /// has scale 0; a non-finite key or value cannot be stored and is
    /// [`AttentionError::NonFiniteKv`](crate::AttentionError::NonFiniteKv).
    Int8,
}

impl KvDtype {
    /// Every type, in the order of their names in [`FromStr`].
    pub const ALL: [Self; 4] = [Self::Model, Self::F16, Self::Bf16, Self::Int8];

    /// Whether the cache stores fewer bytes than the layer's float type.
    pub fn is_narrow(self) -> bool {
        self != Self::Model
    }

    /// Bytes one position of one key/value head of `head_dim` features takes, for keys or for
    /// values, with its scale where the type has one; `model_bytes`: the layer's float size.
    pub fn row_bytes(self, head_dim: usize, model_bytes: usize) -> usize {
        match self {
            Self::Model => head_dim * model_bytes,
            Self::F16 | Self::Bf16 => head_dim * 2,
            Self::Int8 => head_dim + 4,
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Model => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
            Self::Int8 => "int8",
        })
    }
}

impl FromStr for KvDtype {
    type Err = String;

    /// `f32` (the layer's float type, `f32` for every command of the workspace), `f16`,
    /// `bf16` or `int8`.
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|dtype| dtype.to_string() == name)
            .ok_or_else(|| format!("unknown cache type `{name}`: expected f32, f16, bf16 or int8"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_read_back_and_bytes_shrink() {
        for dtype in KvDtype::ALL {
            assert_eq!(dtype.to_string().parse::<KvDtype>(), Ok(dtype));
        }
        assert!("fp8".parse::<KvDtype>().unwrap_err().contains("fp8"));
        let bytes = KvDtype::ALL.map(|dtype| dtype.row_bytes(64, 4));
        assert_eq!(bytes, [256, 128, 128, 68]);
        let int8_share = bytes[3] as f64 / bytes[0] as f64;
        assert!(
            int8_share <= 0.27,
            "int8 with its scale: {int8_share} of f32"
        );
    }
}
