//! Ragged steps over a page pool: every sequence's outputs equal, step by step, those of the same
//! sequence run alone through a dense `KvCache` — for mixes of decoding rows and prompt chunks,
//! pages that do and do not divide the lengths, shared prefixes (copied before they are written),
//! windows that let pages go and lengths past the split of the keys; the pool is whole after
//! every release; and bad input is a typed error that changes nothing.

use crate::common::{randn, seeded_layer};

use attention_core::{
    AttentionError, Kernel, KvCache, MultiHeadAttention, MultiHeadAttentionConfig, PagePool,
    PageTable, RaggedStep, RopeConfig,
};
use burn::prelude::*;

/// Relative to the reference's largest magnitude.
const RTOL: f64 = 1e-5;
const CONTEXT: usize = 200;

/// The chapter's layer, and one with a single key/value head (the CPU kernel then splits a
/// sequence's keys across threads past one key block), rotary positions, a soft-cap and sinks.
fn configs() -> [MultiHeadAttentionConfig; 2] {
    [
        MultiHeadAttentionConfig::new(16, 16, CONTEXT, 2).with_qkv_bias(true),
        MultiHeadAttentionConfig::new(16, 16, CONTEXT, 4)
            .with_num_kv_heads(Some(1))
            .with_rope(Some(RopeConfig::new()))
            .with_softcap(Some(5.0))
            .with_sinks(true),
    ]
}

fn assert_close(found: Tensor<impl Backend, 3>, want: Tensor<impl Backend, 3>, what: &str) {
    assert_eq!(found.dims(), want.dims(), "{what}: shapes");
    let [found, want] = [found.into_data(), want.into_data()]
        .map(|data| data.convert::<f64>().to_vec::<f64>().unwrap());
    let scale = want.iter().fold(1e-3f64, |most, x| most.max(x.abs()));
    let error = found
        .iter()
        .zip(&want)
        .fold(0.0f64, |most, (f, w)| most.max((f - w).abs()));
    assert!(
        error <= RTOL * scale,
        "{what}: off by {error:e} (largest magnitude {scale:e})"
    );
}

/// Sequences fed through a pool in steps, each checked against the same sequence fed alone, in
/// the same chunks, through a dense cache.
struct Run<B: Backend> {
    layer: MultiHeadAttention<B>,
    pool: PagePool,
    pages: attention_core::LayerPages<B>,
    tables: Vec<PageTable>,
    caches: Vec<KvCache<B>>,
    /// Each sequence's whole input, `[1, len, 16]`, and how much of it has been fed.
    inputs: Vec<(Tensor<B, 3>, usize)>,
}

impl<B: Backend> Run<B> {
    fn new(
        config: &MultiHeadAttentionConfig,
        pool: PagePool,
        lengths: &[usize],
        device: &B::Device,
    ) -> Self {
        let layer = seeded_layer::<B>(config, 5, device);
        let pages = layer.new_pages(&pool).unwrap();
        let window = layer.sliding_window();
        Self {
            tables: lengths
                .iter()
                .map(|_| PageTable::new(CONTEXT, window))
                .collect(),
            caches: lengths.iter().map(|_| layer.new_cache()).collect(),
            inputs: lengths
                .iter()
                .enumerate()
                .map(|(s, &len)| (randn([1, len, 16], 100 + s as u64, device), 0))
                .collect(),
            layer,
            pool,
            pages,
        }
    }

    /// Reserves a step of `(sequence, new tokens)`.
    fn reserve(&mut self, step: &[(usize, usize)]) -> Result<RaggedStep, AttentionError> {
        let mut tables: Vec<Option<&mut PageTable>> = self.tables.iter_mut().map(Some).collect();
        let mut sequences: Vec<(&mut PageTable, usize)> = step
            .iter()
            .map(|&(s, new)| (tables[s].take().expect("each sequence once"), new))
            .collect();
        self.pool.step(&mut sequences)
    }

    /// Runs a step of `(sequence, new tokens)` and checks every sequence's outputs.
    fn step(&mut self, step: &[(usize, usize)], what: &str) -> RaggedStep {
        let ragged = self.reserve(step).unwrap();
        let chunks: Vec<Tensor<B, 3>> = step
            .iter()
            .map(|&(s, new)| {
                let (input, fed) = &self.inputs[s];
                input.clone().narrow(1, *fed, new)
            })
            .collect();
        // ndarray, flex and wgpu all have a kernel that reads the pages in place.
        let kernel = Kernel::of::<B>().expect("each backend here has a kernel");
        assert!(Kernel::reads_pages::<B>());
        let (calls, syncs) = (kernel.calls(), attention_core::device_syncs());
        let output = self
            .layer
            .forward_paged(Tensor::cat(chunks.clone(), 1), &ragged, &mut self.pages)
            .unwrap();
        assert_eq!(
            kernel.calls(),
            calls + 1,
            "{what}: one kernel call reads the pages"
        );
        assert_eq!(
            attention_core::device_syncs(),
            syncs,
            "{what}: the step waits for nothing"
        );
        for (index, (&(s, new), chunk)) in step.iter().zip(chunks).enumerate() {
            let want = self
                .layer
                .forward_cached(chunk, &mut self.caches[s])
                .unwrap();
            let found = output.clone().narrow(1, ragged.offsets()[index], new);
            assert_close(found, want, &format!("{what}: sequence {s}"));
            self.inputs[s].1 += new;
        }
        ragged
    }

    fn release_all(&mut self) {
        for table in &mut self.tables {
            self.pool.release(table);
        }
        assert!(self.pool.is_whole(), "pages left held after every release");
    }
}

/// Prompts of 45, 1, 70 and 140 tokens: chunks of prompts beside decoding rows, a prompt that
/// starts late, then decoding steps; pages of 32 (dividing no prompt) and 64.
pub fn ragged_steps_equal_each_sequence_alone<B: Backend>(device: &B::Device) {
    for config in configs() {
        for page_size in [32, 64] {
            let pool = PagePool::new(40, page_size).unwrap();
            let mut run = Run::<B>::new(&config, pool, &[48, 5, 74, 143], device);
            let what = format!("pages of {page_size}, {} kv heads", config.num_kv_heads());
            run.step(&[(0, 30), (1, 1), (2, 70)], &what);
            run.step(&[(0, 15), (1, 1), (2, 1), (3, 140)], &what);
            for _ in 0..3 {
                run.step(&[(0, 1), (1, 1), (2, 1), (3, 1)], &what);
            }
            run.release_all();
        }
    }
}

/// Two sequences continue one prompt's 40 positions in pages of 32: the second maps the first's
/// pages, and the partly filled page both write into next is copied first, for each.
pub fn shared_prefixes_are_copied_before_they_are_written<B: Backend>(device: &B::Device) {
    for config in configs() {
        let pool = PagePool::new(8, 32).unwrap();
        let mut run = Run::<B>::new(&config, pool, &[50, 50], device);
        // Both sequences start with the same 40 tokens.
        let prompt = run.inputs[0].0.clone().narrow(1, 0, 40);
        let own = run.inputs[1].0.clone().narrow(1, 40, 10);
        run.inputs[1].0 = Tensor::cat(vec![prompt, own], 1);
        run.step(&[(0, 40)], "the prompt");
        let [first, second] = run.tables.get_disjoint_mut([0, 1]).unwrap();
        *second = run.pool.share(first, 40).unwrap();
        run.caches[1].reset();
        let _ = run
            .layer
            .forward_cached(run.inputs[1].0.clone().narrow(1, 0, 40), &mut run.caches[1]);
        run.inputs[1].1 = 40;
        assert_eq!(
            run.pool.free_pages(),
            6,
            "the prefix's two pages are shared, not copied"
        );
        let step = run.step(&[(0, 1), (1, 1)], "after the shared prefix");
        assert_eq!(
            step.copies().len(),
            2,
            "each writer copies the shared, partly filled page"
        );
        run.step(&[(1, 9), (0, 9)], "after the copies");
        run.release_all();
    }
}

/// A window of 40 keys over pages of 32: the table lets go of pages no query sees any more, and
/// holds at most three however long the sequence.
pub fn windows_let_go_of_pages<B: Backend>(device: &B::Device) {
    let config = configs()[1].clone().with_sliding_window(Some(40));
    let pool = PagePool::new(6, 32).unwrap();
    let mut run = Run::<B>::new(&config, pool, &[190, 20], device);
    run.step(&[(0, 100), (1, 20)], "a windowed prompt");
    for _ in 0..9 {
        run.step(&[(0, 10)], "windowed chunks");
        assert!(
            run.tables[0].pages_held() <= 3,
            "{} pages held",
            run.tables[0].pages_held()
        );
    }
    assert_eq!(run.tables[0].len(), 190);
    run.release_all();
}

/// A step the pool cannot hold is refused, and the pool and every table stay as they were: the
/// other sequences go on as if it had never been asked for.
pub fn out_of_pages_changes_nothing<B: Backend>(device: &B::Device) {
    let pool = PagePool::new(4, 32).unwrap();
    let mut run = Run::<B>::new(&configs()[0], pool, &[70, 70], device);
    run.step(&[(0, 60)], "the first prompt");
    let free = run.pool.free_pages();
    let error = run.reserve(&[(0, 1), (1, 70)]).unwrap_err();
    assert_eq!(error, AttentionError::OutOfPages { needed: 3, free: 2 });
    assert_eq!(
        (
            run.pool.free_pages(),
            run.tables[0].len(),
            run.tables[1].len()
        ),
        (free, 60, 0)
    );
    run.step(&[(0, 10)], "after the refusal");
    run.release_all();
}

/// Bad input is an error naming it, and nothing changes.
pub fn bad_ragged_input_is_a_typed_error<B: Backend>(device: &B::Device) {
    assert!(matches!(
        PagePool::new(4, 48),
        Err(AttentionError::PageSize { size: 48, .. })
    ));
    assert!(matches!(
        PagePool::new(0, 32),
        Err(AttentionError::PoolSize { pages: 0 })
    ));
    let config = configs()[0].clone();
    let pool = PagePool::new(4, 32).unwrap();
    let mut run = Run::<B>::new(&config, pool, &[20, 20], device);
    let step = run.reserve(&[(0, 5), (1, 3)]).unwrap();
    let x = randn::<B, 3>([1, 7, 16], 1, device);
    assert_eq!(
        run.layer
            .forward_paged(x, &step, &mut run.pages)
            .unwrap_err(),
        AttentionError::RaggedShape {
            tokens: 8,
            found: [1, 7, 16]
        }
    );
    // Another layer's pages: more key/value heads.
    let other = seeded_layer::<B>(&configs()[1], 1, device);
    let mut other_pages = other.new_pages(&run.pool).unwrap();
    let x = randn::<B, 3>([1, 8, 16], 1, device);
    assert!(matches!(
        run.layer.forward_paged(x.clone(), &step, &mut other_pages),
        Err(AttentionError::PagesLayout { .. })
    ));
    // A table of another, larger pool names pages this one does not have.
    let mut big = PagePool::new(64, 32).unwrap();
    let mut foreign = PageTable::new(CONTEXT, None);
    for _ in 0..40 {
        big.step(&mut [(&mut foreign, 32)]).unwrap();
        if foreign.pages_held() > 4 {
            break;
        }
    }
    let free = run.pool.free_pages();
    assert!(matches!(
        run.pool.step(&mut [(&mut foreign, 1)]),
        Err(AttentionError::PageOutOfRange { .. }) | Err(AttentionError::PageNotHeld { .. })
    ));
    assert_eq!(run.pool.free_pages(), free);
    // Past the context.
    let mut long = PageTable::new(CONTEXT, None);
    assert_eq!(
        run.pool.step(&mut [(&mut long, CONTEXT + 1)]).unwrap_err(),
        AttentionError::ContextOverflow {
            seq: CONTEXT + 1,
            context_length: CONTEXT
        }
    );
    // The good step still runs.
    run.layer.forward_paged(x, &step, &mut run.pages).unwrap();
}

test_support::backend_tests!(
    ragged_steps_equal_each_sequence_alone,
    shared_prefixes_are_copied_before_they_are_written,
    windows_let_go_of_pages,
    out_of_pages_changes_nothing,
    bad_ragged_input_is_a_typed_error,
);

/// Under `Autodiff` the paged path says it is for inference.
#[test]
fn the_paged_path_is_for_inference() {
    type B = burn::backend::Autodiff<test_support::NdArray>;
    let device = Default::default();
    let layer = seeded_layer::<B>(&configs()[0], 1, &device);
    let mut pool = PagePool::new(2, 32).unwrap();
    let mut pages = layer.new_pages(&pool).unwrap();
    let mut table = PageTable::new(CONTEXT, None);
    let step = pool.step(&mut [(&mut table, 3)]).unwrap();
    let x = randn::<B, 3>([1, 3, 16], 1, &device);
    assert_eq!(
        layer.forward_paged(x, &step, &mut pages).unwrap_err(),
        AttentionError::PagedWithAutodiff
    );
}
