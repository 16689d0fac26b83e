//! The page pool's bookkeeping: which pages are free, who holds each, and each sequence's table.
//! No keys or values live here: each layer keeps its own storage for every page of the pool
//! ([`LayerPages`](crate::LayerPages)), and a page id means the same slots in all of them.

use crate::KvDtype;
use crate::error::AttentionError;
use crate::paged::step::{PageCopy, RaggedStep, SequenceStep};

/// Fixed-size pages of key/value positions, handed out to [`PageTable`]s and taken back.
///
/// A page is held by every table that maps it (a count of references): two sequences with a
/// common prefix share that prefix's pages ([`share`](Self::share)), and a page is free again
/// when its last holder lets it go. Pages are reserved for a whole step at once, before any
/// layer runs ([`step`](Self::step)): a layer never allocates.
#[derive(Debug, Clone)]
pub struct PagePool {
    page_size: usize,
    /// How many tables map each page: 0 for a free page.
    references: Vec<u32>,
    /// The free pages; the next one handed out is the last.
    free: Vec<u32>,
    /// What each layer's storage for the pool keeps keys and values as.
    kv_dtype: KvDtype,
}

/// What marks a table's entry whose page a sliding window has let go.
const RELEASED: u32 = u32::MAX;

impl PagePool {
    /// The smallest page: the GPU kernel's key tile.
    pub const MIN_PAGE_SIZE: usize = 32;
    /// The most pages a pool holds: the GPU kernel reads page ids as `f32`, exact to 2²⁴.
    pub const MAX_PAGES: usize = 1 << 24;
    /// The page size a pool gets unless told otherwise: a CPU key block (see BENCHMARKS.md,
    /// "Paged KV cache").
    pub const DEFAULT_PAGE_SIZE: usize = 128;

    /// A pool of `pages` free pages of `page_size` positions each.
    ///
    /// Errors when `page_size` is not a power of two of at least [`MIN_PAGE_SIZE`](Self::MIN_PAGE_SIZE)
    /// or `pages` is 0 or more than [`MAX_PAGES`](Self::MAX_PAGES).
    pub fn new(pages: usize, page_size: usize) -> Result<Self, AttentionError> {
        if !page_size.is_power_of_two() || page_size < Self::MIN_PAGE_SIZE {
            return Err(AttentionError::PageSize {
                size: page_size,
                min: Self::MIN_PAGE_SIZE,
            });
        }
        if pages == 0 || pages > Self::MAX_PAGES {
            return Err(AttentionError::PoolSize { pages });
        }
        Ok(Self {
            page_size,
            references: vec![0; pages],
            free: (0..pages as u32).rev().collect(),
            kv_dtype: KvDtype::Model,
        })
    }

    /// The same pool, its layers' storage ([`MultiHeadAttention::new_pages`](crate::MultiHeadAttention::new_pages))
    /// keeping keys and values as `kv_dtype` (see [`KvDtype`]).
    pub fn with_kv_dtype(mut self, kv_dtype: KvDtype) -> Self {
        self.kv_dtype = kv_dtype;
        self
    }

    /// What the layers' storage for this pool keeps keys and values as.
    pub fn kv_dtype(&self) -> KvDtype {
        self.kv_dtype
    }

    /// Positions per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Pages in the pool, free or held.
    pub fn pages(&self) -> usize {
        self.references.len()
    }

    /// Pages no table holds.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Whether every page is free.
    pub fn is_whole(&self) -> bool {
        self.free.len() == self.references.len()
    }

    /// Pages that `positions` positions fill.
    pub fn pages_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.page_size)
    }

    /// A new table holding the pages of `table`'s first `positions` positions (a common prefix,
    /// shared, not copied): the sequence it starts goes on from position `positions`. A shared
    /// page that is only partly filled is copied when either table writes into it next.
    ///
    /// Errors when `table` has fewer positions, or when its window has already let go of pages
    /// of that prefix.
    pub fn share(
        &mut self,
        table: &PageTable,
        positions: usize,
    ) -> Result<PageTable, AttentionError> {
        self.check_table(table)?;
        if positions > table.len {
            return Err(AttentionError::SharePastTable {
                positions,
                len: table.len,
            });
        }
        let pages = table.pages[..self.pages_for(positions)].to_vec();
        if pages.contains(&RELEASED) {
            return Err(AttentionError::ShareReleased { positions });
        }
        for &page in &pages {
            self.references[page as usize] += 1;
        }
        Ok(PageTable {
            capacity: table.capacity,
            window: table.window,
            pages,
            len: positions,
        })
    }

    /// Lets go of every page of `table`, which is empty afterwards.
    pub fn release(&mut self, table: &mut PageTable) {
        for page in table.pages.drain(..).filter(|&page| page != RELEASED) {
            self.unreference(page);
        }
        table.len = 0;
    }

    /// The pages a step of `new` positions for each table would take from the free pages, net
    /// of those the tables' windows give back: what [`step`](Self::step) needs free, for a
    /// caller that reserves several attention kinds' tables and checks them all first.
    pub fn pages_needed(&self, sequences: &[(&PageTable, usize)]) -> usize {
        let plans: Vec<Plan> = sequences
            .iter()
            .map(|&(table, new)| self.plan(table, new))
            .collect();
        self.net_need(&plans)
    }

    /// Reserves the pages for a step of `new` more positions of each sequence, advances each
    /// table by its `new` positions, and returns the step every layer of the tables' attention
    /// kind runs on. Pages a table's window no query can see any more are let go first; a
    /// shared, partly filled last page that a sequence writes into is replaced by a copy of its
    /// own (the step lists the copies each layer makes).
    ///
    /// Errors, and changes nothing, when a table is not of this pool, holds pages no longer held,
    /// would pass its capacity, when a sequence has no new positions, or when the free pages do
    /// not suffice ([`AttentionError::OutOfPages`]).
    pub fn step(
        &mut self,
        sequences: &mut [(&mut PageTable, usize)],
    ) -> Result<RaggedStep, AttentionError> {
        if sequences.is_empty() {
            return Err(AttentionError::EmptyBatch);
        }
        let window = sequences[0].0.window;
        let mut plans = Vec::with_capacity(sequences.len());
        for (index, (table, new)) in sequences.iter().enumerate() {
            self.check_table(table)?;
            if *new == 0 {
                return Err(AttentionError::EmptySequence);
            }
            if table.window != window {
                return Err(AttentionError::StepWindows {
                    sequence: index,
                    found: table.window,
                    expected: window,
                });
            }
            if table.len + new > table.capacity {
                return Err(AttentionError::ContextOverflow {
                    seq: table.len + new,
                    context_length: table.capacity,
                });
            }
            plans.push(self.plan(table, *new));
        }
        self.check_shared_holders(sequences)?;
        let needed = self.net_need(&plans);
        if needed > self.free.len() {
            return Err(AttentionError::OutOfPages {
                needed,
                free: self.free.len(),
            });
        }
        // Nothing has changed so far; from here on nothing fails.
        let mut copies = Vec::new();
        let mut steps = Vec::with_capacity(sequences.len());
        for ((table, new), plan) in sequences.iter_mut().zip(&plans) {
            for index in plan.released.clone() {
                let page = std::mem::replace(&mut table.pages[index], RELEASED);
                self.unreference(page);
            }
            if let Some(index) = plan.copied {
                let from = table.pages[index];
                let to = self.take();
                self.unreference(from);
                table.pages[index] = to;
                copies.push(PageCopy { from, to });
            }
            for _ in 0..plan.added {
                let page = self.take();
                table.pages.push(page);
            }
            steps.push(SequenceStep {
                past: table.len,
                new: *new,
            });
            table.len += *new;
        }
        let tables = sequences
            .iter()
            .map(|(table, _)| {
                table
                    .pages
                    .iter()
                    .map(|&page| page.min(self.last_page()))
                    .collect()
            })
            .collect();
        Ok(RaggedStep::new(
            self.page_size,
            self.pages(),
            window,
            steps,
            tables,
            copies,
        ))
    }

    /// What a step of `new` positions does to `table`.
    fn plan(&self, table: &PageTable, new: usize) -> Plan {
        // The first position a query of this step, or of any later one, sees.
        let first_seen = table
            .window
            .map_or(0, |window| (table.len + 1).saturating_sub(window));
        let released_end = (first_seen / self.page_size).min(table.pages.len());
        let released_start = table.pages[..released_end]
            .iter()
            .take_while(|&&page| page == RELEASED)
            .count();
        let last = table.len / self.page_size;
        let copied = (!table.len.is_multiple_of(self.page_size)
            && self.references[table.pages[last] as usize] > 1)
            .then_some(last);
        Plan {
            released: released_start..released_end,
            released_pages: table.pages[released_start..released_end].to_vec(),
            copied,
            added: self.pages_for(table.len + new) - table.pages.len(),
        }
    }

    /// Pages the `plans` take from the free list, less those their releases give back.
    fn net_need(&self, plans: &[Plan]) -> usize {
        let mut letting_go = std::collections::HashMap::<u32, u32>::new();
        for page in plans.iter().flat_map(|plan| &plan.released_pages) {
            *letting_go.entry(*page).or_default() += 1;
        }
        let freed = letting_go
            .iter()
            .filter(|&(&page, &count)| self.references[page as usize] == count)
            .count();
        let taken: usize = plans
            .iter()
            .map(|plan| plan.added + usize::from(plan.copied.is_some()))
            .sum();
        taken.saturating_sub(freed)
    }

    /// Checks that `table`'s pages are pages of this pool that are held.
    fn check_table(&self, table: &PageTable) -> Result<(), AttentionError> {
        if table.pages.len() < self.pages_for(table.len) {
            return Err(AttentionError::TableTooShort {
                pages: table.pages.len(),
                positions: table.len,
            });
        }
        let mut seen = std::collections::HashSet::new();
        for &page in table.pages.iter().filter(|&&page| page != RELEASED) {
            if page as usize >= self.pages() {
                return Err(AttentionError::PageOutOfRange {
                    page,
                    pages: self.pages(),
                });
            }
            if self.references[page as usize] == 0 {
                return Err(AttentionError::PageNotHeld { page });
            }
            if !seen.insert(page) {
                return Err(AttentionError::DuplicatePage { page });
            }
        }
        Ok(())
    }

    /// Checks that no page appears in more of the step's tables than hold it.
    fn check_shared_holders(
        &self,
        sequences: &[(&mut PageTable, usize)],
    ) -> Result<(), AttentionError> {
        let mut holders = std::collections::HashMap::<u32, u32>::new();
        for (table, _) in sequences {
            for &page in table.pages.iter().filter(|&&page| page != RELEASED) {
                *holders.entry(page).or_default() += 1;
            }
        }
        match holders
            .into_iter()
            .find(|&(page, count)| count > self.references[page as usize])
        {
            Some((page, _)) => Err(AttentionError::DuplicatePage { page }),
            None => Ok(()),
        }
    }

    fn take(&mut self) -> u32 {
        let page = self.free.pop().expect("the step checked the free pages");
        self.references[page as usize] = 1;
        page
    }

    fn unreference(&mut self, page: u32) {
        let references = &mut self.references[page as usize];
        *references -= 1;
        if *references == 0 {
            self.free.push(page);
        }
    }

    /// A page id every table entry may name, read or not: the tables a kernel gets name a held
    /// page for every entry, the released ones included (they are never read).
    fn last_page(&self) -> u32 {
        (self.pages() - 1) as u32
    }
}

/// What a step does to one table.
struct Plan {
    /// Entries whose pages the window lets go.
    released: std::ops::Range<usize>,
    /// Their pages.
    released_pages: Vec<u32>,
    /// The entry whose shared, partly filled page is copied before it is written.
    copied: Option<usize>,
    /// Pages appended.
    added: usize,
}

/// One sequence's pages for one attention kind, in position order: position `p` lies in page
/// `p / page_size` of the table, at slot `p % page_size`. Owned by whoever schedules the
/// sequences; the pool changes it as steps are reserved.
///
/// Not `Clone`: a copy that outlived [`PagePool::release`] of the original would name pages
/// that are no longer its own. [`PagePool::share`] gives a second table over the same prefix.
#[derive(Debug)]
pub struct PageTable {
    capacity: usize,
    window: Option<usize>,
    pages: Vec<u32>,
    len: usize,
}

impl PageTable {
    /// An empty table for a sequence of up to `capacity` positions (the layers' context
    /// length), attended over by layers with a sliding window of `window` keys (or none): a
    /// windowed table lets go of the pages no query can see any more.
    pub fn new(capacity: usize, window: Option<usize>) -> Self {
        Self {
            capacity,
            window,
            pages: Vec::new(),
            len: 0,
        }
    }

    /// Positions stored so far (the next one's position).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The window of the layers this table serves.
    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// Pages this table holds now (those a window let go not counted).
    pub fn pages_held(&self) -> usize {
        self.pages.iter().filter(|&&page| page != RELEASED).count()
    }
}
