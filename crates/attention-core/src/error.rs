//! Errors a user's input can cause: a bad config, a misshapen input, a full cache.

use thiserror::Error;

/// What was wrong with a [config](crate::MultiHeadAttentionConfig), an input or a
/// [cache](crate::KvCache).
///
/// Every fallible method returns it (`try_init`, `try_forward`,
/// `forward_cached`, …); the panicking variants (`init`, `forward`) panic with its message.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum AttentionError {
    /// A size in the config is zero.
    #[error("`{name}` must be at least 1, got 0")]
    ZeroSize {
        /// The config field that is zero.
        name: &'static str,
    },
    /// `output_dim` does not split evenly into `num_heads` heads.
    #[error("`output_dim` ({output_dim}) must be divisible by `num_heads` ({num_heads})")]
    HeadsDoNotDivide {
        /// The configured output width.
        output_dim: usize,
        /// The configured number of heads.
        num_heads: usize,
    },
    /// `num_kv_heads` does not divide `num_heads` (each key/value head serves a whole group of
    /// query heads).
    #[error("`num_heads` ({num_heads}) must be divisible by `num_kv_heads` ({num_kv_heads})")]
    KvHeadsDoNotDivide {
        /// The configured number of query heads.
        num_heads: usize,
        /// The configured number of key/value heads.
        num_kv_heads: usize,
    },
    /// Rotary embeddings rotate pairs of features: the head width must be even.
    #[error("rotary embeddings need an even head_dim, got {0}")]
    RopeOddHeadDim(usize),
    /// Partial rotary embeddings rotate pairs of features: `rotary_dim` must be even.
    #[error("rotary embeddings need an even rotary_dim, got {0}")]
    RopeOddRotaryDim(usize),
    /// Partial rotary embeddings turn the first `rotary_dim` features of a head: no more than
    /// it has.
    #[error("rotary_dim ({rotary_dim}) must be at most head_dim ({head_dim})")]
    RopeRotaryDimTooLarge {
        /// The configured rotary width.
        rotary_dim: usize,
        /// The layer's head width.
        head_dim: usize,
    },
    /// The scores' `scale` or `softcap` is not finite or not positive.
    #[error("`{name}` must be finite and positive, got {value}")]
    ScoreParameter {
        /// `scale` or `softcap`.
        name: &'static str,
        /// The value given.
        value: f64,
    },
    /// The query/key norm's epsilon is not finite or not positive.
    #[error("q/k norm `epsilon` must be finite and positive, got {0}")]
    QkNormEpsilon(f64),
    /// A rotary-embedding parameter is not finite, not positive, or out of order.
    #[error("rotary embedding `{name}` is invalid: {value}")]
    RopeParameter {
        /// The parameter.
        name: &'static str,
        /// Its value.
        value: f64,
    },
    /// Positions whose shape is not `[batch, seq]` of the input.
    #[error("positions have shape {found:?}, expected [batch, seq] = {expected:?}")]
    PositionsShape {
        /// `[batch, seq]` of the input.
        expected: [usize; 2],
        /// The positions' shape.
        found: [usize; 2],
    },
    /// The dropout probability is outside `[0, 1)`.
    #[error("`dropout` must be in [0, 1), got {0}")]
    DropoutOutOfRange(f64),
    /// The input's last dimension is not the layer's `input_dim`.
    #[error(
        "input has {found} features in its last dimension, the layer expects input_dim = {expected}"
    )]
    InputDim {
        /// The layer's `input_dim`.
        expected: usize,
        /// The input's last dimension.
        found: usize,
    },
    /// The input has no tokens.
    #[error("input sequence is empty (seq = 0)")]
    EmptySequence,
    /// The input has no sequences.
    #[error("input batch is empty (batch = 0)")]
    EmptyBatch,
    /// The explicit path would materialize attention scores larger than
    /// [`EXPLICIT_SCORES_LIMIT`](crate::EXPLICIT_SCORES_LIMIT) bytes.
    #[error(
        "the explicit path would hold attention scores of shape {shape:?} ({gib:.1} GiB per \
         tensor, several at once); use the fused path (`AttentionPath::Fused`, `--path fused`), \
         which never materializes them, or a shorter sequence or smaller batch"
    )]
    ExplicitTooLarge {
        /// `[batch, heads, queries, keys]`.
        shape: [usize; 4],
        /// The size of one such tensor in GiB.
        gib: f64,
    },
    /// The key/value cache would need more memory than can be addressed.
    #[error(
        "the key/value cache would hold {positions} positions of {heads} heads × {head_dim} \
         features for a batch of {batch}, more than can be addressed"
    )]
    CacheTooLarge {
        /// Batch size.
        batch: usize,
        /// Heads stored.
        heads: usize,
        /// Features per head.
        head_dim: usize,
        /// Positions asked for.
        positions: usize,
    },
    /// The sequence (or the cache after this step) is longer than `context_length`.
    #[error("sequence of {seq} tokens exceeds context_length = {context_length}")]
    ContextOverflow {
        /// Tokens the step would hold in total.
        seq: usize,
        /// The layer's `context_length`.
        context_length: usize,
    },
    /// A key-padding mask whose shape is not `[batch, keys]`: the input's `[batch, seq]`, or
    /// with a cache `[batch, cached + seq]`.
    #[error("key-padding mask has shape {found:?}, expected [batch, keys] = {expected:?}")]
    PaddingShape {
        /// `[batch, seq]` of the input.
        expected: [usize; 2],
        /// The mask's shape.
        found: [usize; 2],
    },
    /// The input's batch size differs from the one the cache was filled with.
    #[error("input batch size {found} does not match the cache's batch size {expected}")]
    CacheBatch {
        /// The cache's batch size.
        expected: usize,
        /// The input's batch size.
        found: usize,
    },
    /// A sliding-window cache asked to rewind to a position whose window reaches keys it has
    /// already dropped.
    #[error(
        "cannot rewind the cache to {to} positions: its window has dropped positions before \
         {kept_from}"
    )]
    CacheRewind {
        /// The length asked for.
        to: usize,
        /// The first position the cache still holds.
        kept_from: usize,
    },
    /// The cache was made for a layer of another shape.
    #[error(
        "cache holds {cache_heads} heads of {cache_head_dim} for {cache_context} positions, \
         the layer has {heads} heads of {head_dim} and context_length = {context}"
    )]
    CacheLayout {
        /// Heads in the cache.
        cache_heads: usize,
        /// Head width in the cache.
        cache_head_dim: usize,
        /// Capacity of the cache.
        cache_context: usize,
        /// Heads of the layer.
        heads: usize,
        /// Head width of the layer.
        head_dim: usize,
        /// `context_length` of the layer.
        context: usize,
    },
    /// The query, key and value of [`causal_attention`](crate::causal_attention) do not fit
    /// together.
    #[error(
        "query {query:?}, key {key:?} and value {value:?} do not fit {heads} heads: expected \
         [batch, queries, heads · head_dim] and two [batch, keys, kv_heads · head_dim] with \
         keys ≥ queries and kv_heads dividing heads"
    )]
    CoreShapes {
        /// The query's shape.
        query: [usize; 3],
        /// The key's shape.
        key: [usize; 3],
        /// The value's shape.
        value: [usize; 3],
        /// The heads asked for.
        heads: usize,
    },
    /// Document boundaries whose `[batch, seq]` is not the input's.
    #[error("documents cover shape {found:?}, expected [batch, seq] = {expected:?}")]
    DocumentsShape {
        /// `[batch, seq]` of the input.
        expected: [usize; 2],
        /// The documents' `[batch, seq]`.
        found: [usize; 2],
    },
    /// A segment id that does not describe documents in order.
    #[error("segment id {id} at row {row}, position {position} {problem}")]
    SegmentIds {
        /// The row of the id.
        row: usize,
        /// Its position in the row.
        position: usize,
        /// The id.
        id: i64,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// A document of no tokens.
    #[error("document {document} of row {row} is empty: every document has a token at least")]
    EmptyDocument {
        /// The row.
        row: usize,
        /// The document's index in the row.
        document: usize,
    },
    /// A row whose documents do not add up to the row's length.
    #[error("the documents of row {row} hold {sum} tokens, the rows hold {seq}")]
    DocumentsDoNotFill {
        /// The row.
        row: usize,
        /// Its documents' tokens.
        sum: usize,
        /// The rows' length (the first row's sum).
        seq: usize,
    },
    /// Key padding that covers part of a document only: a document is padding or is not.
    #[error(
        "the key-padding mask pads part of document {document} of row {row}: a document must be \
         all padding or none"
    )]
    PaddingSplitsDocument {
        /// The row.
        row: usize,
        /// The document's index in the row.
        document: usize,
    },
    /// Document boundaries given to a cached (decoding) call, which continues one sequence per
    /// row.
    #[error(
        "document boundaries are for whole packed rows (`forward`, `try_forward`, \
         `forward_traced`); a cached call continues one sequence per row"
    )]
    DocumentsWithCache,
    /// A page pool's page size is not a power of two of at least the smallest.
    #[error("a page holds a power of two of at least {min} positions, got {size}")]
    PageSize {
        /// The size asked for.
        size: usize,
        /// [`PagePool::MIN_PAGE_SIZE`](crate::PagePool::MIN_PAGE_SIZE).
        min: usize,
    },
    /// A page pool of no pages, or of more than [`PagePool::MAX_PAGES`](crate::PagePool::MAX_PAGES).
    #[error(
        "a page pool holds 1 to {} pages, got {pages}",
        crate::PagePool::MAX_PAGES
    )]
    PoolSize {
        /// The count asked for.
        pages: usize,
    },
    /// The pool has fewer free pages than a step needs; nothing was reserved.
    #[error("out of pages: the step needs {needed} free pages, the pool has {free}")]
    OutOfPages {
        /// Pages the step takes, net of those it gives back.
        needed: usize,
        /// Free pages.
        free: usize,
    },
    /// A page table names a page past the pool (a table of another pool).
    #[error("page {page} is past the pool's {pages} pages (a table of another pool?)")]
    PageOutOfRange {
        /// The page id.
        page: u32,
        /// Pages in the pool.
        pages: usize,
    },
    /// A page table names a page the pool holds free (a table of another pool, or one whose
    /// pages were released).
    #[error("page {page} is free in this pool: the table is not one of its own")]
    PageNotHeld {
        /// The page id.
        page: u32,
    },
    /// A page appears twice in one table, or in more of a step's tables than hold it.
    #[error("page {page} appears in more places than hold it")]
    DuplicatePage {
        /// The page id.
        page: u32,
    },
    /// A page table has fewer pages than its positions fill.
    #[error("a table of {pages} pages cannot hold its {positions} positions")]
    TableTooShort {
        /// Entries in the table.
        pages: usize,
        /// Positions it says it holds.
        positions: usize,
    },
    /// A shared prefix longer than the table it is taken from.
    #[error("cannot share {positions} positions of a table of {len}")]
    SharePastTable {
        /// The prefix asked for.
        positions: usize,
        /// Positions in the table.
        len: usize,
    },
    /// A shared prefix whose first pages a sliding window has already let go.
    #[error("the first {positions} positions are no longer all held: the window let pages go")]
    ShareReleased {
        /// The prefix asked for.
        positions: usize,
    },
    /// The tables of one step serve layers of different sliding windows: a step is one
    /// attention kind's.
    #[error("sequence {sequence}'s table has window {found:?}, the step's first {expected:?}")]
    StepWindows {
        /// The sequence, by its index in the step.
        sequence: usize,
        /// Its table's window.
        found: Option<usize>,
        /// The first table's.
        expected: Option<usize>,
    },
    /// A ragged call's storage or step does not belong to this layer: another head layout,
    /// another pool, or tables of another window.
    #[error(
        "pages of {found} do not fit this layer and step ({expected}): each layer has storage          of its own, made by its `new_pages` for the step's pool"
    )]
    PagesLayout {
        /// The layer and step's `kv_heads × head_dim, pages × page_size, window`.
        expected: String,
        /// The storage's or the step's.
        found: String,
    },
    /// A ragged call's input is not `[1, tokens, input_dim]` with the step's tokens.
    #[error(
        "a ragged call takes [1, {tokens}, input_dim] (the step's tokens packed), got {found:?}"
    )]
    RaggedShape {
        /// The step's tokens.
        tokens: usize,
        /// The input's shape.
        found: [usize; 3],
    },
    /// A ragged call over pages under `Autodiff`: the paged path serves inference only.
    #[error(
        "the paged path is for inference: run it on the inner backend (`model.valid()`), or          train with `forward` and `Documents`"
    )]
    PagedWithAutodiff,
    /// A cache of a narrow [`KvDtype`](crate::KvDtype) where the step's keys go to storage that
    /// does not keep that type.
    #[error(
        "a key/value cache of {kv_dtype} is not read where this step's keys go: {storage} (the CPU \
         kernel reads f16, bf16 and int8 caches, the GPU kernel f16 and int8, on the fused or \
         default path without `Autodiff`)"
    )]
    KvDtypeUnsupported {
        /// The cache's type.
        kv_dtype: crate::KvDtype,
        /// Where the step's keys would be kept.
        storage: &'static str,
    },
    /// A key or value an int8 cache cannot store: no scale represents an infinity or NaN.
    #[error(
        "the {kind} of sequence {sequence} at position {position} is {value}: an int8 cache \
         stores finite keys and values only"
    )]
    NonFiniteKv {
        /// `key` or `value`.
        kind: &'static str,
        /// The sequence: the batch row, or the index in a ragged step.
        sequence: usize,
        /// Its position in that sequence.
        position: usize,
        /// The first non-finite element.
        value: f32,
    },
    /// The backend's device failed while running the layer (a lost GPU, a driver error).
    #[error("the device failed while running the attention layer: {reason}")]
    Device {
        /// What the backend said.
        reason: String,
    },
}
