//! A key/value cache's storage in host memory, in a layout the CPU kernel reads in place: a
//! decoding step on ndarray or burn-flex then reads the cached keys and values where they lie,
//! instead of copying the cache out of a Burn tensor at every step.

use std::ops::Range;

use burn::prelude::*;
use burn::tensor::{DType, TensorData};

use super::kernel::KernelFloat;

/// Keys and values of `batch` sequences, room for `allocated` positions each, each key/value
/// head's positions side by side: a decoding step's scores and weighted values over one head
/// then stream through memory, where with each position's heads side by side every key would
/// lie a position's width from the last.
///
/// # Shapes
/// - `keys`, `values`: `[batch, kv_heads, allocated, head_dim]`
#[derive(Debug, Clone)]
pub(crate) struct HostKv<E> {
    pub keys: Vec<E>,
    pub values: Vec<E>,
    pub batch: usize,
    pub kv_heads: usize,
    pub allocated: usize,
    pub head_dim: usize,
}

impl<E: KernelFloat> HostKv<E> {
    fn zeros(batch: usize, kv_heads: usize, allocated: usize, head_dim: usize) -> Self {
        let len = batch * kv_heads * allocated * head_dim;
        Self {
            keys: vec![E::zero(); len],
            values: vec![E::zero(); len],
            batch,
            kv_heads,
            allocated,
            head_dim,
        }
    }

    /// New storage of `allocated` positions per sequence with slots `carried` of this one at
    /// its front.
    fn moved(&self, allocated: usize, carried: Range<usize>) -> Self {
        let mut moved = Self::zeros(self.batch, self.kv_heads, allocated, self.head_dim);
        let head_dim = self.head_dim;
        for (to, from) in [
            (&mut moved.keys, &self.keys),
            (&mut moved.values, &self.values),
        ] {
            for (to, from) in to
                .chunks_mut(allocated * head_dim)
                .zip(from.chunks(self.allocated * head_dim))
            {
                to[..carried.len() * head_dim]
                    .copy_from_slice(&from[carried.start * head_dim..carried.end * head_dim]);
            }
        }
        moved
    }

    /// Writes `[batch, new, kv_heads · head_dim]` keys and values at slots `at .. at + new`.
    fn write(&mut self, at: usize, keys: &[E], values: &[E]) {
        let (kv_heads, head_dim) = (self.kv_heads, self.head_dim);
        let new = keys.len() / (self.batch * kv_heads * head_dim);
        for (to, from) in [(&mut self.keys, keys), (&mut self.values, values)] {
            for (to, from) in to
                .chunks_mut(kv_heads * self.allocated * head_dim)
                .zip(from.chunks(new * kv_heads * head_dim))
            {
                for (position, from) in from.chunks_exact(kv_heads * head_dim).enumerate() {
                    for (head, from) in from.chunks_exact(head_dim).enumerate() {
                        let slot = head * self.allocated + at + position;
                        to[slot * head_dim..(slot + 1) * head_dim].copy_from_slice(from);
                    }
                }
            }
        }
    }

    /// Writes one position's `[kv_heads · head_dim]` key and value at slot `slot` of sequence
    /// `sequence`.
    fn write_slot(&mut self, sequence: usize, slot: usize, key: &[E], value: &[E]) {
        let (kv_heads, head_dim, allocated) = (self.kv_heads, self.head_dim, self.allocated);
        for (to, from) in [(&mut self.keys, key), (&mut self.values, value)] {
            for (head, from) in from.chunks_exact(head_dim).enumerate() {
                let at = ((sequence * kv_heads + head) * allocated + slot) * head_dim;
                to[at..at + head_dim].copy_from_slice(from);
            }
        }
    }

    /// Copies slots `from` of every sequence and head over the slots from `to` on.
    fn copy_slots(&mut self, from: std::ops::Range<usize>, to: usize) {
        let head_dim = self.head_dim;
        for data in [&mut self.keys, &mut self.values] {
            for head in data.chunks_mut(self.allocated * head_dim) {
                head.copy_within(from.start * head_dim..from.end * head_dim, to * head_dim);
            }
        }
    }

    /// Burn tensors of the same keys and values, in the layout of the tensor cache.
    ///
    /// # Shapes
    /// - output: two `[batch, kv_heads, allocated, head_dim]`
    fn into_tensors<B: Backend>(self, device: &B::Device) -> (Tensor<B, 4>, Tensor<B, 4>)
    where
        E: burn::tensor::Element,
    {
        let shape = [self.batch, self.kv_heads, self.allocated, self.head_dim];
        let tensor = |data: Vec<E>| Tensor::<B, 4>::from_data(TensorData::new(data, shape), device);
        (tensor(self.keys), tensor(self.values))
    }
}

/// [`HostKv`] in the precision the kernel runs in for the layer's dtype (as
/// [`super::op`] picks it: `f64` for `f64`, `f32` otherwise).
#[derive(Debug, Clone)]
pub(crate) enum HostStorage {
    F32(HostKv<f32>),
    F64(HostKv<f64>),
}

/// Runs `$body` with `$kv` bound to the [`HostKv`] inside a [`HostStorage`], whatever its
/// precision.
macro_rules! with_host_kv {
    ($storage:expr, $kv:ident => $body:expr) => {
        match $storage {
            HostStorage::F32($kv) => $body,
            HostStorage::F64($kv) => $body,
        }
    };
}
pub(crate) use with_host_kv;

impl HostStorage {
    /// Empty storage for `allocated` positions of `batch` sequences of `kv_heads` heads of
    /// `head_dim` elements each, in the precision the kernel uses for `dtype`.
    pub fn zeros(
        dtype: DType,
        batch: usize,
        kv_heads: usize,
        allocated: usize,
        head_dim: usize,
    ) -> Self {
        match dtype {
            DType::F64 => Self::F64(HostKv::zeros(batch, kv_heads, allocated, head_dim)),
            _ => Self::F32(HostKv::zeros(batch, kv_heads, allocated, head_dim)),
        }
    }

    /// The keys and values of a tensor cache, moved to host memory.
    ///
    /// # Shapes
    /// - `keys`, `values`: `[batch, kv_heads, allocated, head_dim]`
    pub fn from_tensors<B: Backend>(keys: Tensor<B, 4>, values: Tensor<B, 4>) -> Self {
        fn host<B: Backend, E: KernelFloat + burn::tensor::Element>(
            keys: Tensor<B, 4>,
            values: Tensor<B, 4>,
        ) -> HostKv<E> {
            let [batch, kv_heads, allocated, head_dim] = keys.dims();
            let floats = |tensor: Tensor<B, 4>| {
                tensor
                    .into_data()
                    .convert::<E>()
                    .into_vec::<E>()
                    .expect("converted to E")
            };
            HostKv {
                keys: floats(keys),
                values: floats(values),
                batch,
                kv_heads,
                allocated,
                head_dim,
            }
        }
        match keys.dtype() {
            DType::F64 => Self::F64(host(keys, values)),
            _ => Self::F32(host(keys, values)),
        }
    }

    /// The same keys and values as Burn tensors, in the tensor cache's layout.
    pub fn into_tensors<B: Backend>(self, device: &B::Device) -> (Tensor<B, 4>, Tensor<B, 4>) {
        with_host_kv!(self, kv => kv.into_tensors::<B>(device))
    }

    pub fn batch(&self) -> usize {
        with_host_kv!(self, kv => kv.batch)
    }

    pub fn allocated(&self) -> usize {
        with_host_kv!(self, kv => kv.allocated)
    }

    /// See [`HostKv::moved`].
    pub fn moved(&self, allocated: usize, carried: Range<usize>) -> Self {
        match self {
            Self::F32(kv) => Self::F32(kv.moved(allocated, carried)),
            Self::F64(kv) => Self::F64(kv.moved(allocated, carried)),
        }
    }

    /// Writes the new positions' keys and values at slots `at ..`.
    ///
    /// # Shapes
    /// - `keys`, `values`: `[batch, new, kv_heads · head_dim]`
    pub fn write<B: Backend>(&mut self, at: usize, keys: Tensor<B, 3>, values: Tensor<B, 3>) {
        fn floats<B: Backend, E: KernelFloat + burn::tensor::Element>(
            tensor: Tensor<B, 3>,
        ) -> TensorData {
            tensor.into_data().convert::<E>()
        }
        match self {
            Self::F32(kv) => {
                let [keys, values] = [keys, values].map(floats::<B, f32>);
                kv.write(at, slice(&keys), slice(&values));
            }
            Self::F64(kv) => {
                let [keys, values] = [keys, values].map(floats::<B, f64>);
                kv.write(at, slice(&keys), slice(&values));
            }
        }
    }
}

impl HostStorage {
    /// Writes the keys and values of a step's tokens, token `i` at `places[i]`, a `(sequence,
    /// slot)`.
    ///
    /// # Shapes
    /// - `keys`, `values`: `[1, tokens, kv_heads · head_dim]`
    pub fn write_places<B: Backend>(
        &mut self,
        keys: Tensor<B, 3>,
        values: Tensor<B, 3>,
        places: &[(usize, usize)],
    ) {
        fn write<E: KernelFloat + burn::tensor::Element>(
            kv: &mut HostKv<E>,
            [keys, values]: [TensorData; 2],
            places: &[(usize, usize)],
        ) {
            let [keys, values] = [keys, values].map(|data| data.convert_dtype(E::dtype()));
            let width = kv.kv_heads * kv.head_dim;
            let rows = slice::<E>(&keys)
                .chunks_exact(width)
                .zip(slice::<E>(&values).chunks_exact(width));
            for (&(sequence, slot), (key, value)) in places.iter().zip(rows) {
                kv.write_slot(sequence, slot, key, value);
            }
        }
        let data = [keys.into_data(), values.into_data()];
        with_host_kv!(self, kv => write(kv, data, places))
    }

    /// Bytes of one element.
    pub fn element_size(&self) -> usize {
        match self {
            Self::F32(_) => 4,
            Self::F64(_) => 8,
        }
    }

    /// Copies slots `from` of every sequence and head over the slots from `to` on.
    pub fn copy_positions(&mut self, from: std::ops::Range<usize>, to: usize) {
        with_host_kv!(self, kv => kv.copy_slots(from, to))
    }
}

fn slice<E: burn::tensor::Element>(data: &TensorData) -> &[E] {
    data.as_slice().expect("converted to E")
}
