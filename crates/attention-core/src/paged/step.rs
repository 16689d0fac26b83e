//! One step of a ragged batch over pages: what every layer of one attention kind reads.

use std::any::Any;
use std::sync::{Arc, Mutex};

use burn::prelude::*;
use burn::tensor::{DType, TensorData};

use crate::documents::Documents;

/// One sequence's share of a [`RaggedStep`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequenceStep {
    /// Positions cached before the step (the first new query's position).
    pub past: usize,
    /// New positions: 1 for a decoding step, a chunk of a prompt, or a whole prompt.
    pub new: usize,
}

impl SequenceStep {
    /// Keys the sequence's last new query sees at most: the cached and the new positions.
    pub fn keys(&self) -> usize {
        self.past + self.new
    }
}

/// A page each layer copies before the step writes: a shared, partly filled page that one of
/// the step's sequences writes into gets a copy of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageCopy {
    /// The shared page.
    pub from: u32,
    /// The sequence's own copy.
    pub to: u32,
}

/// A step of any number of sequences, each with its own count of new queries and its own
/// cached length, over the pages of a [`PagePool`](crate::PagePool): made by
/// [`PagePool::step`](crate::PagePool::step) once per step and attention kind, read by every
/// layer of that kind ([`MultiHeadAttention::forward_paged`](crate::MultiHeadAttention::forward_paged)).
///
/// The new tokens are packed along one axis, sequence after sequence, with no padding: sequence
/// `s`'s are tokens `offsets[s] .. offsets[s + 1]` (FlashAttention's `cu_seqlens`), at
/// positions `past, past + 1, …` of the sequence.
///
/// # Shapes
/// - tables: `[sequences, per_sequence]` page ids
#[derive(Clone)]
pub struct RaggedStep {
    page_size: usize,
    pool_pages: usize,
    window: Option<usize>,
    sequences: Vec<SequenceStep>,
    /// Each sequence's page ids, padded to the longest table with ids that are never read.
    tables: Vec<u32>,
    per_sequence: usize,
    copies: Vec<PageCopy>,
    /// Where each sequence's tokens start, and the end of the last.
    offsets: Vec<usize>,
    /// What a kernel's launches read of the step on a device (the tables; the GPU forward
    /// pass's work list), uploaded by the first layer that asks there and shared by the step's
    /// later layers (and clones).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    uploads: Arc<Mutex<Vec<(StepUpload, Uploaded)>>>,
}

/// A tensor a kernel uploaded of a step, of its backend's type.
type Uploaded = Arc<dyn Any + Send + Sync>;

/// What a kernel uploads of a [`RaggedStep`] once per step and device: the key under which the
/// step keeps it for its later layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
pub(crate) enum StepUpload {
    /// [`RaggedStep::tables_on`].
    Tables,
    /// The GPU forward pass's work list for launches of these sizes (`kernels::gpu`).
    WorkList {
        heads: usize,
        kv_heads: usize,
        pairs_per_block: usize,
    },
}

impl std::fmt::Debug for RaggedStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaggedStep")
            .field("page_size", &self.page_size)
            .field("pool_pages", &self.pool_pages)
            .field("window", &self.window)
            .field("sequences", &self.sequences)
            .field("tables", &self.tables)
            .field("copies", &self.copies)
            .finish_non_exhaustive()
    }
}

impl RaggedStep {
    pub(crate) fn new(
        page_size: usize,
        pool_pages: usize,
        window: Option<usize>,
        sequences: Vec<SequenceStep>,
        tables: Vec<Vec<u32>>,
        copies: Vec<PageCopy>,
    ) -> Self {
        let per_sequence = tables.iter().map(Vec::len).max().unwrap_or(0);
        let padded = tables
            .into_iter()
            .flat_map(|mut table| {
                let pad = table.last().copied().unwrap_or(0);
                table.resize(per_sequence, pad);
                table
            })
            .collect();
        let offsets = std::iter::once(0)
            .chain(sequences.iter().scan(0, |end, sequence| {
                *end += sequence.new;
                Some(*end)
            }))
            .collect();
        Self {
            page_size,
            pool_pages,
            window,
            sequences,
            tables: padded,
            per_sequence,
            copies,
            offsets,
            uploads: Arc::default(),
        }
    }

    /// The step's sequences, in the order their tokens are packed.
    pub fn sequences(&self) -> &[SequenceStep] {
        &self.sequences
    }

    /// New tokens of all sequences together: the packed axis's length.
    pub fn tokens(&self) -> usize {
        *self.offsets.last().expect("offsets start at 0")
    }

    /// Where each sequence's tokens start on the packed axis, and the end of the last
    /// (`sequences + 1` entries).
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// The packed axis as one row of documents, a sequence's new tokens each: the per-sequence
    /// offsets packed training uses.
    pub fn documents(&self) -> Documents {
        let lengths = self.sequences.iter().map(|sequence| sequence.new).collect();
        Documents::from_lengths(&[lengths]).expect("every sequence has new tokens")
    }

    /// Each new token's position in its sequence, `[1, tokens]`.
    pub fn positions<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2, Int> {
        let positions: Vec<i64> = self
            .sequences
            .iter()
            .flat_map(|sequence| (sequence.past..sequence.keys()).map(|p| p as i64))
            .collect();
        Tensor::from_data(TensorData::new(positions, [1, self.tokens()]), device)
    }

    /// Sequence `sequence`'s page ids (those a window let go name a page never read).
    pub fn table(&self, sequence: usize) -> &[u32] {
        &self.tables[sequence * self.per_sequence..(sequence + 1) * self.per_sequence]
    }

    /// Every table, `[sequences, per_sequence]` row-major, and `per_sequence`.
    pub(crate) fn tables(&self) -> (&[u32], usize) {
        (&self.tables, self.per_sequence)
    }

    /// The step for the GPU kernel, on `device`: each sequence's row holds its first token's
    /// index on the packed axis, its new tokens, its keys, then its page ids, `[sequences, 3 +
    /// per_sequence]` (`i32`: the kernel reads them as `u32`). Uploaded once, by the first layer
    /// of the step that asks on that device, and shared by the others.
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    pub(crate) fn tables_on<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2, Int> {
        self.uploaded_once(StepUpload::Tables, device, || {
            let width = 3 + self.per_sequence;
            let rows = self
                .sequences
                .iter()
                .enumerate()
                .flat_map(|(index, sequence)| {
                    let head = [self.offsets[index], sequence.new, sequence.keys()];
                    head.into_iter()
                        .chain(self.table(index).iter().map(|&page| page as usize))
                })
                .collect();
            (rows, [self.sequences.len(), width])
        })
    }

    /// `what` of this step on `device`: `rows` (`[rows, columns]`, row-major) uploaded as `i32`
    /// by the first layer that asks there, the same tensor for the step's later layers.
    ///
    /// # Panics
    /// When a value does not fit an `i32` (the pool's page cap keeps ids and lengths below).
    #[cfg_attr(not(any(feature = "wgpu", feature = "cuda")), allow(dead_code))]
    pub(crate) fn uploaded_once<B: Backend>(
        &self,
        what: StepUpload,
        device: &B::Device,
        rows: impl FnOnce() -> (Vec<usize>, [usize; 2]),
    ) -> Tensor<B, 2, Int> {
        let mut uploads = self
            .uploads
            .lock()
            .expect("no upload panics while holding it");
        let cached = uploads
            .iter()
            .filter(|(key, _)| *key == what)
            .find_map(|(_, tensor)| tensor.downcast_ref::<Tensor<B, 2, Int>>())
            .filter(|tensor| tensor.device() == *device);
        if let Some(tensor) = cached {
            return tensor.clone();
        }
        let (rows, shape) = rows();
        let rows: Vec<i32> = rows
            .into_iter()
            .map(|value| i32::try_from(value).expect("the pool's ids and lengths fit an i32"))
            .collect();
        let tensor =
            Tensor::<B, 2, Int>::from_data(TensorData::new(rows, shape), (device, DType::I32));
        // A step read on two devices keeps the first's; the other's is uploaded each time.
        if !uploads.iter().any(|(key, _)| *key == what) {
            uploads.push((what, Arc::new(tensor.clone())));
        }
        tensor
    }

    /// The pages each layer copies before writing the step.
    pub fn copies(&self) -> &[PageCopy] {
        &self.copies
    }

    /// Positions per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Pages in the pool the step was reserved in.
    pub fn pool_pages(&self) -> usize {
        self.pool_pages
    }

    /// The sliding window of the layers the step's tables serve.
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// Where new token `token` of sequence `sequence` is stored: `(page, slot)`.
    pub(crate) fn place(&self, sequence: usize, token: usize) -> (usize, usize) {
        let position = self.sequences[sequence].past + token;
        let page = self.table(sequence)[position / self.page_size];
        (page as usize, position % self.page_size)
    }

    /// The first key any of sequence `sequence`'s new queries sees, rounded down to its page's
    /// first position: the pages before it may have been let go.
    pub(crate) fn first_page_key(&self, sequence: usize) -> usize {
        let past = self.sequences[sequence].past;
        let first = self
            .window
            .map_or(0, |window| (past + 1).saturating_sub(window));
        first / self.page_size * self.page_size
    }
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use std::cell::Cell;

    use burn::backend::NdArray;

    use super::{RaggedStep, SequenceStep, StepUpload};

    #[test]
    fn a_step_uploads_each_of_its_tensors_once_for_all_its_layers() {
        let sequences = vec![
            SequenceStep { past: 40, new: 1 },
            SequenceStep { past: 0, new: 3 },
        ];
        let step = RaggedStep::new(32, 4, None, sequences, vec![vec![0, 1], vec![2]], vec![]);
        let device = Default::default();
        // Each sequence's first token, new tokens, keys, then its pages (padded with its last).
        let tables = step
            .tables_on::<NdArray>(&device)
            .into_data()
            .convert::<i64>();
        assert_eq!(
            tables.to_vec::<i64>().unwrap(),
            [0, 1, 41, 0, 1, 1, 3, 3, 2, 2]
        );

        let uploads = Cell::new(0);
        let upload = |what| {
            step.clone().uploaded_once::<NdArray>(what, &device, || {
                uploads.set(uploads.get() + 1);
                (vec![uploads.get()], [1, 1])
            })
        };
        let work = |pairs_per_block| StepUpload::WorkList {
            heads: 4,
            kv_heads: 2,
            pairs_per_block,
        };
        let first = upload(work(8));
        for _ in 0..3 {
            assert_eq!(upload(work(8)).into_data(), first.clone().into_data());
        }
        assert_eq!(
            uploads.get(),
            1,
            "the later layers (and clones) share the first's"
        );
        upload(work(16));
        assert_eq!(uploads.get(), 2, "a launch of another size has its own");
    }
}
