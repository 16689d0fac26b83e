//! Where one layer keeps the keys and values of every page of a pool: the CPU kernel's host
//! memory, or Burn tensors that any backend gathers from (the fallback). Page ids and tables
//! are the pool's (`crate::paged`); this module only writes, copies and reads the slots it is
//! told to.

use burn::prelude::*;
use burn::tensor::DType;

use super::backends::Kernel;
use super::cpu::HostStorage;
use super::device_kv::DeviceKv;
use crate::KvDtype;
use crate::error::AttentionError;
use crate::paged::{PageCopy, RaggedStep};

/// A layer's keys and values for every page of a pool.
///
/// # Shapes
/// - `CpuHost`: `[kv_heads, pages · page_size, head_dim]` (one sequence of every page's
///   positions), the layout the CPU kernel reads in place
/// - `Tensors`: keys, values `[pages, page_size, kv_heads · head_dim]` (see [`DeviceKv`]),
///   which the GPU kernel reads as one `[pages · page_size, kv_heads · head_dim]` pool
#[derive(Debug, Clone)]
pub(crate) enum PagedStorage<B: Backend> {
    CpuHost(HostStorage),
    Tensors {
        keys: DeviceKv<B>,
        values: DeviceKv<B>,
    },
}

impl<B: Backend> PagedStorage<B> {
    /// Zeroed storage for `pages` pages: in host memory for the CPU kernel, else in tensors.
    ///
    /// Errors for a narrow `kv_dtype` that no kernel reads here: anywhere but in the CPU
    /// kernel's host memory and the GPU kernel's tensors (there f16 and int8).
    pub(crate) fn zeros(
        [pages, page_size, kv_heads, head_dim]: [usize; 4],
        device: &B::Device,
        dtype: DType,
        kv_dtype: KvDtype,
    ) -> Result<Self, AttentionError> {
        if Kernel::of::<B>() == Some(Kernel::Cpu) && Kernel::reads_pages::<B>() {
            // One sequence of every page's positions: each head's pages side by side.
            let shape = [1, kv_heads, pages * page_size, head_dim];
            return Ok(Self::CpuHost(HostStorage::zeros(dtype, kv_dtype, shape)));
        }
        if Kernel::of::<B>() == Some(Kernel::Gpu) && Kernel::reads_pages::<B>() {
            super::storage::check_device_reads::<B>(kv_dtype, device)?;
        } else if kv_dtype.is_narrow() {
            return Err(AttentionError::KvDtypeUnsupported {
                kv_dtype,
                storage: "the pages' Burn tensors (a backend without a kernel of this crate)",
            });
        }
        let zeros = || {
            DeviceKv::zeros(
                [pages, page_size, kv_heads, head_dim],
                device,
                dtype,
                kv_dtype,
            )
        };
        Ok(Self::Tensors {
            keys: zeros(),
            values: zeros(),
        })
    }

    /// Ends a layer's step over these pages, as a dense cache's ([`super::storage::end_step`]):
    /// nothing for host pages.
    pub(crate) fn end_step(&self) -> Result<(), AttentionError> {
        match self {
            Self::CpuHost(_) => Ok(()),
            Self::Tensors { keys, .. } => super::storage::end_step::<B>(&keys.device()),
        }
    }

    /// Copies each shared page over its sequence's own copy.
    pub(crate) fn copy_pages(&mut self, copies: &[PageCopy], page_size: usize) {
        for &PageCopy { from, to } in copies {
            let (from, to) = (from as usize, to as usize);
            match self {
                Self::CpuHost(host) => {
                    host.copy_positions(from * page_size..(from + 1) * page_size, to * page_size)
                }
                Self::Tensors { keys, values } => {
                    for rows in [keys, values] {
                        let page = rows.clone().narrow(0, from, 1);
                        *rows = rows.clone().assigned([to..to + 1, 0..page_size], page);
                    }
                }
            }
        }
    }

    /// Checks that these pages can keep a step's new keys and values: finite ones, for int8.
    ///
    /// # Shapes
    /// - `keys`, `values`: `[1, tokens, kv_heads · head_dim]`, packed as the step's queries
    pub(crate) fn check_storable(
        &self,
        step: &RaggedStep,
        keys: &Tensor<B, 3>,
        values: &Tensor<B, 3>,
    ) -> Result<(), AttentionError> {
        let int8 = match self {
            Self::CpuHost(host) => host.kv_dtype() == KvDtype::Int8,
            Self::Tensors { keys, .. } => matches!(keys, DeviceKv::Int8 { .. }),
        };
        if !int8 {
            return Ok(());
        }
        super::storage::check_finite([keys, values], |token| {
            let sequence = step.offsets().partition_point(|&start| start <= token) - 1;
            let s = &step.sequences()[sequence];
            (sequence, s.past + token - step.offsets()[sequence])
        })
    }

    /// Writes the step's new keys and values at their sequences' places.
    ///
    /// # Shapes
    /// - `keys`, `values`: `[1, tokens, kv_heads · head_dim]`, packed as the step's queries
    pub(crate) fn write(&mut self, step: &RaggedStep, keys: Tensor<B, 3>, values: Tensor<B, 3>) {
        match self {
            Self::CpuHost(host) => {
                let places: Vec<(usize, usize)> = step
                    .sequences()
                    .iter()
                    .enumerate()
                    .flat_map(|(sequence, s)| (0..s.new).map(move |token| (sequence, token)))
                    .map(|(sequence, token)| {
                        let (page, slot) = step.place(sequence, token);
                        (0, page * step.page_size() + slot)
                    })
                    .collect();
                host.write_places(keys, values, &places);
            }
            Self::Tensors {
                keys: stored_keys,
                values: stored_values,
            } => {
                // Encoded once, then one slice per run of a sequence's tokens within one page.
                let (keys, values) = (
                    stored_keys.encode_like(keys),
                    stored_values.encode_like(values),
                );
                for (sequence, s) in step.sequences().iter().enumerate() {
                    let mut token = 0;
                    while token < s.new {
                        let (page, slot) = step.place(sequence, token);
                        let run = (step.page_size() - slot).min(s.new - token);
                        let from = step.offsets()[sequence] + token;
                        for (stored, new) in
                            [(&mut *stored_keys, &keys), (&mut *stored_values, &values)]
                        {
                            *stored = stored.clone().assigned(
                                [page..page + 1, slot..slot + run],
                                new.clone().narrow(1, from, run),
                            );
                        }
                        token += run;
                    }
                }
            }
        }
    }

    /// Sequence `sequence`'s keys and values from position `first` (a page's first) up to its
    /// last new one, gathered out of tensor storage.
    ///
    /// # Shapes
    /// - output: two `[1, kv_heads, keys − first, head_dim]`
    pub(crate) fn gathered(
        &self,
        step: &RaggedStep,
        sequence: usize,
        first: usize,
        kv_heads: usize,
    ) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let Self::Tensors {
            keys: DeviceKv::Float(keys),
            values: DeviceKv::Float(values),
        } = self
        else {
            unreachable!("host pages and narrow pages are read in place by a kernel")
        };
        let size = step.page_size();
        let end = step.sequences()[sequence].keys();
        let pages: Vec<i64> = step.table(sequence)[first / size..end.div_ceil(size)]
            .iter()
            .map(|&page| i64::from(page))
            .collect();
        let device = keys.device();
        let ids = Tensor::<B, 1, Int>::from_data(
            burn::tensor::TensorData::new(pages.clone(), [pages.len()]),
            &device,
        );
        let gather = |tensor: &Tensor<B, 3>| {
            let width = tensor.dims()[2];
            tensor
                .clone()
                .select(0, ids.clone())
                .reshape([1, pages.len() * size, kv_heads, width / kv_heads])
                .narrow(1, 0, end - first)
                .swap_dims(1, 2)
        };
        (gather(keys), gather(values))
    }
}
