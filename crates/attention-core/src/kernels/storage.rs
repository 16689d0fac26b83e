//! Where a [`KvCache`](crate::KvCache) keeps its keys and values: Burn tensors, or a kernel's own
//! storage. The cache's bookkeeping (positions, window, growth) is one, in `cache.rs`; this module
//! only moves, grows and writes the storage it is told to.

use std::ops::Range;

use burn::prelude::*;
use burn::tensor::DType;

use super::backends::Kernel;
use super::cpu::HostStorage;
use super::device_kv::DeviceKv;
use crate::KvDtype;
use crate::error::AttentionError;

/// A cache's keys and values.
///
/// # Shapes
/// - `Tensors`: keys, values `[batch, kv_heads, allocated, head_dim]`, the layout of Burn's
///   attention op and the explicit path
/// - `CpuHost`: host memory, each head's positions side by side, `[batch, kv_heads, allocated,
///   head_dim]`
/// - `Device`: device tensors in the GPU kernel's layout, keys, values `[batch, allocated,
///   kv_heads · head_dim]` in the cache's [`KvDtype`] (see [`DeviceKv`])
#[derive(Debug, Clone)]
pub(crate) enum KvStorage<B: Backend> {
    Tensors {
        keys: Tensor<B, 4>,
        values: Tensor<B, 4>,
    },
    CpuHost(HostStorage),
    Device {
        keys: DeviceKv<B>,
        values: DeviceKv<B>,
    },
}

/// A step's new keys and values, in the layout of the path that made them; it decides where the
/// cache keeps them.
///
/// # Shapes
/// - `Split`: `[batch, kv_heads, new, head_dim]`, kept in tensors
/// - `SideBySide`: `[batch, new, kv_heads · head_dim]`, kept in the storage of `B`'s kernel
#[derive(Debug, Clone)]
pub(crate) enum NewKv<B: Backend> {
    Split {
        keys: Tensor<B, 4>,
        values: Tensor<B, 4>,
    },
    SideBySide {
        keys: Tensor<B, 3>,
        values: Tensor<B, 3>,
    },
}

impl<B: Backend> NewKv<B> {
    /// `[batch, new]`.
    pub(crate) fn batch_and_len(&self) -> [usize; 2] {
        match self {
            Self::Split { keys, .. } => {
                let [batch, _, new, _] = keys.dims();
                [batch, new]
            }
            Self::SideBySide { keys, .. } => {
                let [batch, new, _] = keys.dims();
                [batch, new]
            }
        }
    }
}

/// The kinds of storage, as [`KvStorage`]'s variants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Tensors,
    CpuHost,
    Device,
}

impl Kind {
    /// The kind that keeps `new`: tensors for split heads, else `B`'s kernel's storage.
    fn for_new<B: Backend>(new: &NewKv<B>) -> Self {
        match new {
            NewKv::Split { .. } => Self::Tensors,
            NewKv::SideBySide { .. } => match Kernel::of::<B>() {
                Some(Kernel::Cpu) => Self::CpuHost,
                Some(Kernel::Gpu) => Self::Device,
                None => unreachable!("side-by-side keys are stored for a kernel"),
            },
        }
    }
}

impl<B: Backend> NewKv<B> {
    /// Checks that a cache of `kv_dtype` can keep these keys and values: a narrow type only in
    /// a kernel's storage that reads it, and int8 only for finite values (`past`: the cached
    /// positions before them, to say where one is not).
    pub(crate) fn check_storable(
        &self,
        kv_dtype: KvDtype,
        past: usize,
    ) -> Result<(), AttentionError> {
        if !kv_dtype.is_narrow() {
            return Ok(());
        }
        match (Kind::for_new(self), self) {
            (kind @ (Kind::CpuHost | Kind::Device), Self::SideBySide { keys, values }) => {
                if kind == Kind::Device {
                    check_device_reads::<B>(kv_dtype, &keys.device())?;
                }
                if kv_dtype == KvDtype::Int8 {
                    let [_, new, _] = keys.dims();
                    check_finite([keys, values], |token| (token / new, past + token % new))?;
                }
                Ok(())
            }
            _ => Err(AttentionError::KvDtypeUnsupported {
                kv_dtype,
                storage: "Burn tensors (the explicit path, `Autodiff`, or a backend without a kernel of this crate)",
            }),
        }
    }
}

/// Checks that the GPU kernel reads a cache of `kv_dtype` on `device`: int8 anywhere, f16 where
/// the device computes in it (wgpu's `SHADER_F16`), bf16 nowhere (WGSL has none).
pub(crate) fn check_device_reads<B: Backend>(
    kv_dtype: KvDtype,
    device: &B::Device,
) -> Result<(), AttentionError> {
    let storage = match kv_dtype {
        KvDtype::Model | KvDtype::Int8 => return Ok(()),
        KvDtype::F16 if B::supports_dtype(device, DType::F16) => return Ok(()),
        KvDtype::F16 => "the GPU kernel's device tensors, on a device without f16 (`SHADER_F16`)",
        KvDtype::Bf16 => "the GPU kernel's device tensors (it reads f16 and int8 caches)",
    };
    Err(AttentionError::KvDtypeUnsupported { kv_dtype, storage })
}

/// Checks that a step's keys and values are finite (as an int8 cache needs): else the first
/// that is not, its `(sequence, position)` given by `place` from its token's index.
///
/// # Shapes
/// - `tensors`: keys and values `[batch, tokens, kv_heads · head_dim]`
pub(crate) fn check_finite<B: Backend>(
    tensors: [&Tensor<B, 3>; 2],
    place: impl Fn(usize) -> (usize, usize),
) -> Result<(), AttentionError> {
    for (tensor, kind) in tensors.into_iter().zip(["key", "value"]) {
        let width = tensor.dims()[2];
        let data = tensor.clone().into_data().convert::<f32>();
        let floats: &[f32] = data.as_slice().expect("converted to f32");
        if let Some(at) = floats.iter().position(|x| !x.is_finite()) {
            let (sequence, position) = place(at / width);
            return Err(AttentionError::NonFiniteKv {
                kind,
                sequence,
                position,
                value: floats[at],
            });
        }
    }
    Ok(())
}

impl<B: Backend> KvStorage<B> {
    fn kind(&self) -> Kind {
        match self {
            Self::Tensors { .. } => Kind::Tensors,
            Self::CpuHost(_) => Kind::CpuHost,
            Self::Device { .. } => Kind::Device,
        }
    }

    /// The batch size stored.
    pub(crate) fn batch(&self) -> usize {
        match self {
            Self::Tensors { keys, .. } => keys.dims()[0],
            Self::CpuHost(host) => host.batch(),
            Self::Device { keys, .. } => keys.dims()[0],
        }
    }

    /// Positions there is room for.
    pub(crate) fn allocated(&self) -> usize {
        match self {
            Self::Tensors { keys, .. } => keys.dims()[2],
            Self::CpuHost(host) => host.allocated(),
            Self::Device { keys, .. } => keys.dims()[1],
        }
    }

    /// The storage `new` is written to: `old` moved into the kind `new` needs, kept as it is when
    /// it has room for `allocate` positions and nothing moves, else new storage of `allocate`
    /// positions with `old`'s slots `carried` at its front.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn prepared(
        old: Option<Self>,
        new: &NewKv<B>,
        kv_heads: usize,
        allocate: usize,
        carried: Range<usize>,
        compact: bool,
        kv_dtype: KvDtype,
    ) -> Self {
        let kind = Kind::for_new(new);
        let (device, dtype, row) = match new {
            NewKv::Split { keys, .. } => {
                let [_, heads, _, head_dim] = keys.dims();
                (keys.device(), keys.dtype(), heads * head_dim)
            }
            NewKv::SideBySide { keys, .. } => (keys.device(), keys.dtype(), keys.dims()[2]),
        };
        let [batch, _] = new.batch_and_len();
        let old = old.map(|old| old.into_kind(kind, kv_heads, &device));
        match old {
            Some(old) if !compact && old.allocated() >= allocate => old,
            Some(old) => old.moved(allocate, carried),
            None => match kind {
                Kind::Tensors => {
                    let zeros =
                        || Tensor::zeros([batch, kv_heads, allocate, row / kv_heads], &device);
                    Self::Tensors {
                        keys: zeros(),
                        values: zeros(),
                    }
                }
                Kind::CpuHost => Self::CpuHost(HostStorage::zeros(
                    dtype,
                    kv_dtype,
                    [batch, kv_heads, allocate, row / kv_heads],
                )),
                Kind::Device => {
                    let shape = [batch, allocate, kv_heads, row / kv_heads];
                    let zeros = || DeviceKv::zeros(shape, &device, dtype, kv_dtype);
                    Self::Device {
                        keys: zeros(),
                        values: zeros(),
                    }
                }
            },
        }
    }

    /// The same keys and values in storage of kind `kind` (through tensor storage, the one
    /// layout every kind converts to and from).
    fn into_kind(self, kind: Kind, kv_heads: usize, device: &B::Device) -> Self {
        if self.kind() == kind {
            return self;
        }
        let (keys, values) = match self {
            Self::Tensors { keys, values } => (keys, values),
            Self::CpuHost(host) => host.into_tensors(device),
            Self::Device { keys, values } => {
                // A cache of the model's type: a narrow one moves nowhere (`check_storable`).
                let split = |rows: DeviceKv<B>| {
                    let DeviceKv::Float(tensor) = rows else {
                        unreachable!("a narrow cache stays in its kernel's storage")
                    };
                    let [batch, allocated, row] = tensor.dims();
                    tensor
                        .reshape([batch, allocated, kv_heads, row / kv_heads])
                        .swap_dims(1, 2)
                };
                (split(keys), split(values))
            }
        };
        match kind {
            Kind::Tensors => Self::Tensors { keys, values },
            Kind::CpuHost => Self::CpuHost(HostStorage::from_tensors(keys, values)),
            Kind::Device => {
                let side_by_side = |tensor: Tensor<B, 4>| {
                    let [batch, heads, allocated, head_dim] = tensor.dims();
                    tensor
                        .swap_dims(1, 2)
                        .reshape([batch, allocated, heads * head_dim])
                };
                Self::Device {
                    keys: DeviceKv::Float(side_by_side(keys)),
                    values: DeviceKv::Float(side_by_side(values)),
                }
            }
        }
    }

    /// New storage of `allocate` positions with slots `carried` of this one at its front.
    fn moved(self, allocate: usize, carried: Range<usize>) -> Self {
        match self {
            Self::Tensors { keys, values } => {
                let move_one = |old: Tensor<B, 4>| {
                    let [batch, heads, _, head_dim] = old.dims();
                    let storage = Tensor::zeros([batch, heads, allocate, head_dim], &old.device());
                    if carried.is_empty() {
                        return storage;
                    }
                    storage.slice_assign(
                        [0..batch, 0..heads, 0..carried.len(), 0..head_dim],
                        old.narrow(2, carried.start, carried.len()),
                    )
                };
                Self::Tensors {
                    keys: move_one(keys),
                    values: move_one(values),
                }
            }
            Self::CpuHost(host) => Self::CpuHost(host.moved(allocate, carried)),
            Self::Device { keys, values } => {
                let move_one = |old: DeviceKv<B>| {
                    let [batch, _] = old.dims();
                    let storage = old.zeroed(allocate);
                    if carried.is_empty() {
                        return storage;
                    }
                    let kept = old.narrow(1, carried.start, carried.len());
                    storage.assigned([0..batch, 0..carried.len()], kept)
                };
                Self::Device {
                    keys: move_one(keys),
                    values: move_one(values),
                }
            }
        }
    }

    /// Ends a decoding step over this storage: on a backend with a kernel of this crate's own,
    /// its queue runs what the step queued without the host waiting for the device
    /// ([`super::end_step`]); on any other backend (whose fusion, if it has one, this crate
    /// cannot reach) the device is synced. Nothing for host storage.
    pub(crate) fn end_step(&self) -> Result<(), AttentionError> {
        let device = match self {
            Self::Tensors { keys, .. } => keys.device(),
            Self::Device { keys, .. } => keys.device(),
            Self::CpuHost(_) => return Ok(()),
        };
        end_step::<B>(&device)
    }

    /// This storage with `new` written at slots `at ..` (in place: the storage is not shared).
    pub(crate) fn written(self, at: usize, new: NewKv<B>) -> Self {
        match (self, new) {
            (Self::Tensors { keys, values }, NewKv::Split { keys: k, values: v }) => {
                let [batch, heads, new, head_dim] = k.dims();
                let slots = [0..batch, 0..heads, at..at + new, 0..head_dim];
                Self::Tensors {
                    keys: keys.slice_assign(slots.clone(), k),
                    values: values.slice_assign(slots, v),
                }
            }
            (Self::CpuHost(mut host), NewKv::SideBySide { keys, values }) => {
                host.write(at, keys, values);
                Self::CpuHost(host)
            }
            (Self::Device { keys, values }, NewKv::SideBySide { keys: k, values: v }) => {
                let [batch, new, _] = k.dims();
                let slots = [0..batch, at..at + new];
                let (k, v) = (keys.encode_like(k), values.encode_like(v));
                Self::Device {
                    keys: keys.assigned(slots.clone(), k),
                    values: values.assigned(slots, v),
                }
            }
            _ => unreachable!("the storage was prepared for this step's layout"),
        }
    }

    /// The keys and values of slots `seen`, from tensor storage.
    ///
    /// # Shapes
    /// - output: two `[batch, kv_heads, seen.len(), head_dim]`
    pub(crate) fn tensors(&self, seen: Range<usize>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        match self {
            Self::Tensors { keys, values } => {
                let view = |tensor: &Tensor<B, 4>| tensor.clone().narrow(2, seen.start, seen.len());
                (view(keys), view(values))
            }
            Self::CpuHost(_) | Self::Device { .. } => {
                unreachable!("a tensor step is appended to tensor storage")
            }
        }
    }
}

/// Ends a layer's decoding step on `device`: on a backend with a kernel of this crate's own, its
/// queue runs what the step queued without the host waiting for the device
/// ([`super::end_step`]); on any other backend (whose fusion, if it has one, this crate cannot
/// reach) the device is synced.
pub(crate) fn end_step<B: Backend>(device: &B::Device) -> Result<(), AttentionError> {
    match super::backends::entry_points::<B>() {
        Some(entry) => {
            (entry.end_step)(device);
            Ok(())
        }
        None => sync::<B>(device),
    }
}

/// Waits for `device` to run what is queued.
fn sync<B: Backend>(device: &B::Device) -> Result<(), AttentionError> {
    DEVICE_SYNCS.with(|syncs| syncs.set(syncs.get() + 1));
    B::sync(device).map_err(|error| AttentionError::Device {
        reason: error.to_string(),
    })
}

thread_local! {
    /// The device syncs a cache has made on this thread ([`device_syncs`]).
    static DEVICE_SYNCS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many times a cache has waited for the device on the calling thread (per thread, as
/// `Kernel::calls`): a test's check that decoding waits for nothing. Behind the `test-hooks`
/// feature.
#[cfg(feature = "test-hooks")]
pub fn device_syncs() -> u64 {
    DEVICE_SYNCS.with(std::cell::Cell::get)
}
