//! A key/value cache's storage in host memory, in a layout the CPU kernel reads in place: a
//! decoding step on ndarray or burn-flex then reads the cached keys and values where they lie,
//! instead of copying the cache out of a Burn tensor at every step.

use std::ops::Range;

use burn::prelude::*;
use burn::tensor::{DType, Element, TensorData};
use half::{bf16, f16};

use super::kernel::{KernelFloat, KvBuffer};
use crate::KvDtype;

/// An element a host cache stores keys and values in: the kernel's compute type itself, or a
/// narrower one that it widens a block at a time ([`KvBuffer`]).
pub(crate) trait Stored: Copy + Send + Sync + std::fmt::Debug + 'static {
    /// The type the kernel computes in over this storage.
    type Compute: KernelFloat + Element;
    /// The zero.
    const ZERO: Self;
    /// Whether each row (one position of one key/value head) carries a scale.
    const SCALED: bool;

    /// Writes `row`, one position of one head, into `to`; returns the row's scale (1 where the
    /// type has none).
    fn encode(row: &[Self::Compute], to: &mut [Self]) -> f32;

    /// The kernel's view of a buffer of this type and its rows' scales.
    fn buffer<'a>(data: &'a [Self], scales: &'a [f32]) -> KvBuffer<'a, Self::Compute>;
}

macro_rules! stored_as_computed {
    ($($float:ty),*) => {$(
        impl Stored for $float {
            type Compute = $float;
            const ZERO: Self = 0.0;
            const SCALED: bool = false;

            fn encode(row: &[Self], to: &mut [Self]) -> f32 {
                to.copy_from_slice(row);
                1.0
            }

            fn buffer<'a>(data: &'a [Self], _: &'a [f32]) -> KvBuffer<'a, Self> {
                KvBuffer::Float(data)
            }
        }
    )*};
}
stored_as_computed!(f32, f64);

impl Stored for f16 {
    type Compute = f32;
    const ZERO: Self = f16::ZERO;
    const SCALED: bool = false;

    /// Rounded to nearest; finite values past the largest half saturate to it.
    fn encode(row: &[f32], to: &mut [Self]) -> f32 {
        let largest = f16::MAX.to_f32();
        for (to, &x) in to.iter_mut().zip(row) {
            let x = if x.is_finite() {
                x.clamp(-largest, largest)
            } else {
                x
            };
            *to = f16::from_f32(x);
        }
        1.0
    }

    fn buffer<'a>(data: &'a [Self], _: &'a [f32]) -> KvBuffer<'a, f32> {
        KvBuffer::F16(data)
    }
}

impl Stored for bf16 {
    type Compute = f32;
    const ZERO: Self = bf16::ZERO;
    const SCALED: bool = false;

    /// Rounded to nearest; finite values that would round past the largest bfloat16 saturate to
    /// it.
    fn encode(row: &[f32], to: &mut [Self]) -> f32 {
        for (to, &x) in to.iter_mut().zip(row) {
            let rounded = bf16::from_f32(x);
            *to = match rounded.is_infinite() && x.is_finite() {
                true => bf16::MAX.copysign(rounded),
                false => rounded,
            };
        }
        1.0
    }

    fn buffer<'a>(data: &'a [Self], _: &'a [f32]) -> KvBuffer<'a, f32> {
        KvBuffer::Bf16(data)
    }
}

impl Stored for i8 {
    type Compute = f32;
    const ZERO: Self = 0;
    const SCALED: bool = true;

    /// Symmetric: `x ≈ scale · q` with `scale = max |x| / 127` and `q = round(x / scale)`, so the
    /// row's largest element is exact. A row of zeros has scale 0. A non-finite element gives
    /// a non-finite scale, so that every output reading the row is NaN rather than silently
    /// wrong (the layer refuses such a row before it gets here).
    fn encode(row: &[f32], to: &mut [Self]) -> f32 {
        let largest = row.iter().fold(0.0f32, |largest, x| largest.max(x.abs()));
        if row.iter().any(|x| !x.is_finite()) {
            to.fill(0);
            return f32::NAN;
        }
        if largest == 0.0 {
            to.fill(0);
            return 0.0;
        }
        let inverse = 127.0 / largest;
        for (to, &x) in to.iter_mut().zip(row) {
            *to = (x * inverse).round().clamp(-127.0, 127.0) as i8;
        }
        largest / 127.0
    }

    fn buffer<'a>(values: &'a [Self], scales: &'a [f32]) -> KvBuffer<'a, f32> {
        KvBuffer::Int8 { values, scales }
    }
}

/// Keys and values of `batch` sequences, room for `allocated` positions each, each key/value
/// head's positions side by side: a decoding step's scores and weighted values over one head
/// then stream through memory, where with each position's heads side by side every key would
/// lie a position's width from the last.
///
/// # Shapes
/// - `keys`, `values`: `[batch, kv_heads, allocated, head_dim]`
/// - `key_scales`, `value_scales`: `[batch, kv_heads, allocated]` for a scaled type, else empty
#[derive(Debug, Clone)]
pub(crate) struct HostKv<S> {
    pub keys: Vec<S>,
    pub values: Vec<S>,
    pub key_scales: Vec<f32>,
    pub value_scales: Vec<f32>,
    pub batch: usize,
    pub kv_heads: usize,
    pub allocated: usize,
    pub head_dim: usize,
}

impl<S: Stored> HostKv<S> {
    fn zeros(batch: usize, kv_heads: usize, allocated: usize, head_dim: usize) -> Self {
        let rows = batch * kv_heads * allocated;
        let scales = if S::SCALED { rows } else { 0 };
        Self {
            keys: vec![S::ZERO; rows * head_dim],
            values: vec![S::ZERO; rows * head_dim],
            key_scales: vec![0.0; scales],
            value_scales: vec![0.0; scales],
            batch,
            kv_heads,
            allocated,
            head_dim,
        }
    }

    /// The kernel's views of the keys and of the values.
    pub fn buffers(&self) -> [KvBuffer<'_, S::Compute>; 2] {
        [
            S::buffer(&self.keys, &self.key_scales),
            S::buffer(&self.values, &self.value_scales),
        ]
    }

    /// New storage of `allocated` positions per sequence with slots `carried` of this one at
    /// its front.
    fn moved(&self, allocated: usize, carried: Range<usize>) -> Self {
        let mut moved = Self::zeros(self.batch, self.kv_heads, allocated, self.head_dim);
        fn carry<T: Copy>(
            to: &mut [T],
            from: &[T],
            [to_rows, from_rows]: [usize; 2],
            width: usize,
            carried: &Range<usize>,
        ) {
            for (to, from) in to
                .chunks_mut(to_rows * width)
                .zip(from.chunks(from_rows * width))
            {
                to[..carried.len() * width]
                    .copy_from_slice(&from[carried.start * width..carried.end * width]);
            }
        }
        let rows = [allocated, self.allocated];
        carry(&mut moved.keys, &self.keys, rows, self.head_dim, &carried);
        carry(
            &mut moved.values,
            &self.values,
            rows,
            self.head_dim,
            &carried,
        );
        if S::SCALED {
            carry(&mut moved.key_scales, &self.key_scales, rows, 1, &carried);
            carry(
                &mut moved.value_scales,
                &self.value_scales,
                rows,
                1,
                &carried,
            );
        }
        moved
    }

    /// Writes one position's key or value of one head into row `row` (`[batch, kv_heads,
    /// allocated]` counted).
    fn write_row(&mut self, row: usize, key: &[S::Compute], value: &[S::Compute]) {
        let head_dim = self.head_dim;
        let elements = row * head_dim..(row + 1) * head_dim;
        let key_scale = S::encode(key, &mut self.keys[elements.clone()]);
        let value_scale = S::encode(value, &mut self.values[elements]);
        if S::SCALED {
            self.key_scales[row] = key_scale;
            self.value_scales[row] = value_scale;
        }
    }

    /// Writes `[batch, new, kv_heads · head_dim]` keys and values at slots `at .. at + new`.
    fn write(&mut self, at: usize, keys: &[S::Compute], values: &[S::Compute]) {
        let width = self.kv_heads * self.head_dim;
        let new = keys.len() / (self.batch * width);
        let rows = keys.chunks_exact(width).zip(values.chunks_exact(width));
        for (token, (key, value)) in rows.enumerate() {
            let (sequence, position) = (token / new, token % new);
            self.write_slot(sequence, at + position, key, value);
        }
    }

    /// Writes one position's `[kv_heads · head_dim]` key and value at slot `slot` of sequence
    /// `sequence`.
    fn write_slot(
        &mut self,
        sequence: usize,
        slot: usize,
        key: &[S::Compute],
        value: &[S::Compute],
    ) {
        let head_dim = self.head_dim;
        let heads = key.chunks_exact(head_dim).zip(value.chunks_exact(head_dim));
        for (head, (key, value)) in heads.enumerate() {
            let row = (sequence * self.kv_heads + head) * self.allocated + slot;
            self.write_row(row, key, value);
        }
    }

    /// Copies slots `from` of every sequence and head over the slots from `to` on.
    fn copy_slots(&mut self, from: Range<usize>, to: usize) {
        fn copy<T: Copy>(
            data: &mut [T],
            allocated: usize,
            width: usize,
            from: &Range<usize>,
            to: usize,
        ) {
            for head in data.chunks_mut(allocated * width) {
                head.copy_within(from.start * width..from.end * width, to * width);
            }
        }
        copy(&mut self.keys, self.allocated, self.head_dim, &from, to);
        copy(&mut self.values, self.allocated, self.head_dim, &from, to);
        if S::SCALED {
            copy(&mut self.key_scales, self.allocated, 1, &from, to);
            copy(&mut self.value_scales, self.allocated, 1, &from, to);
        }
    }

    /// Burn tensors of the same keys and values (widened to the compute type), in the layout
    /// of the tensor cache.
    ///
    /// # Shapes
    /// - output: two `[batch, kv_heads, allocated, head_dim]`
    fn into_tensors<B: Backend>(self, device: &B::Device) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let shape = [self.batch, self.kv_heads, self.allocated, self.head_dim];
        let rows = self.batch * self.kv_heads * self.allocated;
        let tensor = |buffer: KvBuffer<'_, S::Compute>| {
            let mut scratch = vec![<S::Compute as num_traits::Zero>::zero(); buffer.len()];
            let (floats, scales) = buffer.rows(0..rows, self.head_dim, &mut scratch);
            let mut floats = floats.to_vec();
            if let Some(scales) = scales {
                for (row, &scale) in floats.chunks_mut(self.head_dim).zip(scales) {
                    row.iter_mut()
                        .for_each(|x| *x = *x * S::Compute::from_scale(scale));
                }
            }
            Tensor::<B, 4>::from_data(TensorData::new(floats, shape), device)
        };
        let [keys, values] = self.buffers();
        (tensor(keys), tensor(values))
    }
}

/// [`HostKv`] in the type a cache stores: the precision the kernel runs in for the layer's
/// dtype (as [`super::op`] picks it: `f64` for `f64`, `f32` otherwise), or a narrower one
/// ([`KvDtype`]).
#[derive(Debug, Clone)]
pub(crate) enum HostStorage {
    F32(HostKv<f32>),
    F64(HostKv<f64>),
    F16(HostKv<f16>),
    Bf16(HostKv<bf16>),
    Int8(HostKv<i8>),
}

/// Runs `$body` with `$kv` bound to the [`HostKv`] inside a [`HostStorage`], whatever its
/// type.
macro_rules! with_host_kv {
    ($storage:expr, $kv:ident => $body:expr) => {
        match $storage {
            HostStorage::F32($kv) => $body,
            HostStorage::F64($kv) => $body,
            HostStorage::F16($kv) => $body,
            HostStorage::Bf16($kv) => $body,
            HostStorage::Int8($kv) => $body,
        }
    };
}
pub(crate) use with_host_kv;

impl HostStorage {
    /// Empty storage for `allocated` positions of `batch` sequences of `kv_heads` heads of
    /// `head_dim` elements each, in `kv_dtype` (the precision the kernel uses for `dtype` for
    /// [`KvDtype::Model`]).
    pub fn zeros(
        dtype: DType,
        kv_dtype: KvDtype,
        [batch, kv_heads, allocated, head_dim]: [usize; 4],
    ) -> Self {
        match (kv_dtype, dtype) {
            (KvDtype::Model, DType::F64) => {
                Self::F64(HostKv::zeros(batch, kv_heads, allocated, head_dim))
            }
            (KvDtype::Model, _) => Self::F32(HostKv::zeros(batch, kv_heads, allocated, head_dim)),
            (KvDtype::F16, _) => Self::F16(HostKv::zeros(batch, kv_heads, allocated, head_dim)),
            (KvDtype::Bf16, _) => Self::Bf16(HostKv::zeros(batch, kv_heads, allocated, head_dim)),
            (KvDtype::Int8, _) => Self::Int8(HostKv::zeros(batch, kv_heads, allocated, head_dim)),
        }
    }

    /// The keys and values of a tensor cache, moved to host memory in the layer's precision.
    ///
    /// # Shapes
    /// - `keys`, `values`: `[batch, kv_heads, allocated, head_dim]`
    pub fn from_tensors<B: Backend>(keys: Tensor<B, 4>, values: Tensor<B, 4>) -> Self {
        fn host<B: Backend, E: Stored<Compute = E> + Element>(
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
                key_scales: Vec::new(),
                value_scales: Vec::new(),
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

    /// What the storage keeps keys and values as.
    pub fn kv_dtype(&self) -> KvDtype {
        match self {
            Self::F32(_) | Self::F64(_) => KvDtype::Model,
            Self::F16(_) => KvDtype::F16,
            Self::Bf16(_) => KvDtype::Bf16,
            Self::Int8(_) => KvDtype::Int8,
        }
    }

    /// See [`HostKv::moved`].
    pub fn moved(&self, allocated: usize, carried: Range<usize>) -> Self {
        match self {
            Self::F32(kv) => Self::F32(kv.moved(allocated, carried)),
            Self::F64(kv) => Self::F64(kv.moved(allocated, carried)),
            Self::F16(kv) => Self::F16(kv.moved(allocated, carried)),
            Self::Bf16(kv) => Self::Bf16(kv.moved(allocated, carried)),
            Self::Int8(kv) => Self::Int8(kv.moved(allocated, carried)),
        }
    }

    /// Writes the new positions' keys and values at slots `at ..`, rounded to the storage's
    /// type.
    ///
    /// # Shapes
    /// - `keys`, `values`: `[batch, new, kv_heads · head_dim]`
    pub fn write<B: Backend>(&mut self, at: usize, keys: Tensor<B, 3>, values: Tensor<B, 3>) {
        fn write<B: Backend, S: Stored>(
            kv: &mut HostKv<S>,
            at: usize,
            keys: Tensor<B, 3>,
            values: Tensor<B, 3>,
        ) {
            let [keys, values] = [keys, values].map(|t| t.into_data().convert::<S::Compute>());
            kv.write(at, slice(&keys), slice(&values));
        }
        with_host_kv!(self, kv => write(kv, at, keys, values))
    }

    /// Writes the keys and values of a step's tokens, token `i` at `places[i]`, a `(sequence,
    /// slot)`, rounded to the storage's type.
    ///
    /// # Shapes
    /// - `keys`, `values`: `[1, tokens, kv_heads · head_dim]`
    pub fn write_places<B: Backend>(
        &mut self,
        keys: Tensor<B, 3>,
        values: Tensor<B, 3>,
        places: &[(usize, usize)],
    ) {
        fn write<B: Backend, S: Stored>(
            kv: &mut HostKv<S>,
            keys: Tensor<B, 3>,
            values: Tensor<B, 3>,
            places: &[(usize, usize)],
        ) {
            let [keys, values] = [keys, values].map(|t| t.into_data().convert::<S::Compute>());
            let width = kv.kv_heads * kv.head_dim;
            let rows = slice::<S::Compute>(&keys)
                .chunks_exact(width)
                .zip(slice::<S::Compute>(&values).chunks_exact(width));
            for (&(sequence, slot), (key, value)) in places.iter().zip(rows) {
                kv.write_slot(sequence, slot, key, value);
            }
        }
        with_host_kv!(self, kv => write(kv, keys, values, places))
    }

    /// Bytes one position of one key/value head takes in keys or in values, its scale included.
    pub fn row_bytes(&self) -> usize {
        fn bytes<S: Stored>(kv: &HostKv<S>) -> usize {
            kv.head_dim * size_of::<S>() + if S::SCALED { size_of::<f32>() } else { 0 }
        }
        with_host_kv!(self, kv => bytes(kv))
    }

    /// Copies slots `from` of every sequence and head over the slots from `to` on.
    pub fn copy_positions(&mut self, from: Range<usize>, to: usize) {
        with_host_kv!(self, kv => kv.copy_slots(from, to))
    }
}

fn slice<E: Element>(data: &TensorData) -> &[E] {
    data.as_slice().expect("converted to E")
}
