//! Continuous batching: requests come and go while the model runs, every step one ragged batch
//! over a page pool — each running sequence's next token beside chunks of waiting prompts, up to
//! a token budget.
//!
//! A request is admitted, in order of arrival, as soon as the pool has its next chunk's pages and
//! fewer than `max_running` sequences run; its pages are freed the step it ends or is cancelled.
//! When the running sequences' next step does not fit in the pool, the newest is preempted: its
//! pages are freed, its tokens kept, and it waits at the front of the queue to be computed again.
//! A prompt and a sequence being computed again are the same thing to a step: tokens not yet in
//! the cache, fed a chunk at a time; a sequence whose chunk reaches its last token picks its next
//! one.
//!
//! Prefix caching: an admitted request whose prompt begins with whole pages that a running
//! sequence (or a finished one kept within `retain_pages`) has computed maps those pages instead
//! of computing them, each page found by a key chained from its prefix's and confirmed by
//! comparing the ids.
//!
//! ```
//! use burn::backend::NdArray;
//! use gpt::{Engine, EngineConfig, GptConfig, Request};
//!
//! let device = Default::default();
//! let model = GptConfig::new(256, 64, 16, 2, 2).init::<NdArray>(&device);
//! let mut engine = Engine::new(&model, EngineConfig::new(32), &device).unwrap();
//! let first = engine.add(Request::greedy(vec![72, 105], 5)).unwrap();
//! let second = engine.add(Request::greedy(vec![1, 2, 3, 4], 3)).unwrap();
//! let done = engine.run_to_end().unwrap();
//! assert_eq!(done.len(), 2);
//! assert!(engine.pool().is_whole());
//! # let _ = (first, second);
//! ```

use std::collections::VecDeque;
use std::fmt;
use std::hash::{DefaultHasher, Hash, Hasher};

use attention_core::{AttentionError, KvDtype, LayerPages, PagePool};
use burn::prelude::*;
use burn::tensor::TensorData;
use thiserror::Error;

use crate::decoder::{Decoder, DecoderError};
use crate::input::Logits;
use crate::paged::SequencePages;
use crate::sampling::{Sampler, Sampling, SamplingError};

/// How an [`Engine`] schedules its steps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Pages in the pool, shared by every attention kind: the cap on the cache's bytes
    /// (see [`Engine::bytes_per_page`]).
    pub pages: usize,
    /// Positions per page (a power of two, at least [`PagePool::MIN_PAGE_SIZE`]).
    pub page_size: usize,
    /// The most sequences a step runs.
    pub max_running: usize,
    /// The most tokens a step feeds, decoding rows first, then chunks of prompts.
    pub step_tokens: usize,
    /// Beside `d` decoding sequences, a step feeds at most `max(d, prefill_while_decoding)`
    /// prompt tokens (and tokens computed again). A decoding row waits for its whole step, chunks
    /// included: where a step's time grows with its tokens (the CPU), a chunk no longer than the
    /// decoding rows keeps the time between their tokens within about twice a decoding step's
    /// while prompts are admitted, and the floor keeps a prompt moving beside few rows. A step
    /// with no decoding row fills `step_tokens`; a GPU, whose step time barely grows with its
    /// tokens, wants this as large as `step_tokens`.
    pub prefill_while_decoding: usize,
    /// Whether a request whose prompt begins with whole pages another sequence holds maps those
    /// pages instead of computing them (prefix caching).
    pub share_prefixes: bool,
    /// What the pool's pages store keys and values as ([`KvDtype`]); the pool's bytes per page
    /// follow ([`Engine::bytes_per_page`]).
    pub kv_dtype: KvDtype,
    /// Pages that finished requests may keep held for later requests' prefixes; the oldest go
    /// first, and all of them before a running sequence is preempted. 0 keeps none.
    pub retain_pages: usize,
}

impl EngineConfig {
    /// A pool of `pages` pages of [`PagePool::DEFAULT_PAGE_SIZE`], up to 64 sequences and 512
    /// tokens a step; beside decoding rows, as many prompt tokens as rows, at least 32.
    pub fn new(pages: usize) -> Self {
        Self {
            pages,
            page_size: PagePool::DEFAULT_PAGE_SIZE,
            max_running: 64,
            step_tokens: 512,
            prefill_while_decoding: 32,
            share_prefixes: true,
            retain_pages: 0,
            kv_dtype: KvDtype::Model,
        }
    }

    /// With pages of `page_size` positions.
    pub fn with_page_size(self, page_size: usize) -> Self {
        Self { page_size, ..self }
    }

    /// With at most `max_running` sequences a step.
    pub fn with_max_running(self, max_running: usize) -> Self {
        Self {
            max_running,
            ..self
        }
    }

    /// With at most `step_tokens` tokens a step.
    pub fn with_step_tokens(self, step_tokens: usize) -> Self {
        Self {
            step_tokens,
            ..self
        }
    }

    /// With at most `max(decoding rows, prefill_while_decoding)` prompt tokens a step beside
    /// decoding rows.
    pub fn with_prefill_while_decoding(self, prefill_while_decoding: usize) -> Self {
        Self {
            prefill_while_decoding,
            ..self
        }
    }

    /// With prefix sharing on or off.
    pub fn with_share_prefixes(self, share_prefixes: bool) -> Self {
        Self {
            share_prefixes,
            ..self
        }
    }

    /// With the pages storing keys and values as `kv_dtype`.
    pub fn with_kv_dtype(self, kv_dtype: KvDtype) -> Self {
        Self { kv_dtype, ..self }
    }

    /// Finished requests keeping up to `retain_pages` pages for later prefixes.
    pub fn with_retain_pages(self, retain_pages: usize) -> Self {
        Self {
            retain_pages,
            ..self
        }
    }
}

/// An [`EngineConfig`] value out of range.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum EngineError {
    /// `max_running`, `step_tokens` or `prefill_while_decoding` is 0.
    #[error("{field} must be at least 1")]
    Zero {
        /// The field.
        field: &'static str,
    },
    /// Fewer tokens a step than sequences: a running sequence could wait for its turn forever.
    #[error("step_tokens {step_tokens} is below max_running {max_running}")]
    BudgetBelowRunning {
        /// The token budget of a step.
        step_tokens: usize,
        /// The most running sequences.
        max_running: usize,
    },
    /// The pool or its storage refused (page size, pool size).
    #[error(transparent)]
    Attention(#[from] AttentionError),
}

/// One request: a prompt, and how its tokens are chosen and when they stop.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// The prompt's token ids.
    pub ids: Vec<u32>,
    /// The most tokens to generate (at least 1).
    pub max_new_tokens: usize,
    /// How each token is chosen; a draw uses this request's own seeded generator, so its tokens
    /// do not depend on what else runs.
    pub sampling: Sampling,
    /// Tokens that end the request when generated (the stop token is kept).
    pub stop_ids: Vec<u32>,
}

impl Request {
    /// A greedy request without stop ids.
    pub fn greedy(ids: Vec<u32>, max_new_tokens: usize) -> Self {
        Self {
            ids,
            max_new_tokens,
            sampling: Sampling::Greedy,
            stop_ids: Vec::new(),
        }
    }
}

/// Why a request was refused when added; the engine and its other requests are unchanged.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum RequestError {
    /// The prompt has no ids.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// `max_new_tokens` is 0.
    #[error("max_new_tokens must be at least 1")]
    NoNewTokens,
    /// A prompt id is not in the vocabulary.
    #[error("prompt id {id} at position {position} is outside the vocabulary of {vocab_size}")]
    PromptId {
        /// Where in the prompt.
        position: usize,
        /// The id.
        id: u32,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
    /// A stop id is not in the vocabulary.
    #[error("stop id {id} is outside the vocabulary of {vocab_size}")]
    StopId {
        /// The id.
        id: u32,
        /// The model's vocabulary size.
        vocab_size: usize,
    },
    /// The prompt and its new tokens pass the model's context.
    #[error(
        "a prompt of {prompt} ids and {max_new_tokens} new tokens passes the context of {context_length}"
    )]
    PastContext {
        /// The prompt's ids.
        prompt: usize,
        /// The limit of new tokens.
        max_new_tokens: usize,
        /// The model's context length.
        context_length: usize,
    },
    /// The sampling settings are out of range.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// The request alone needs more pages than the whole pool holds.
    #[error("the request needs {needed} pages, the whole pool holds {pages}")]
    LargerThanPool {
        /// Pages its prompt and new tokens need, over every attention kind.
        needed: usize,
        /// The pool's pages.
        pages: usize,
    },
}

/// A request's handle: what its events name, and what [`Engine::cancel`] takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Why a request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// It generated `max_new_tokens` tokens.
    Length,
    /// It generated one of its stop ids (the last token).
    Stop,
    /// [`Engine::cancel`] ended it.
    Cancelled,
}

/// What a step reports, in order: each token as it is made, each request as it ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A request's next token.
    Token {
        /// The request.
        request: RequestId,
        /// The token's id.
        id: u32,
    },
    /// A request ended; its pages are free.
    Finished {
        /// The request.
        request: RequestId,
        /// Why.
        finish: Finish,
    },
}

/// A request that ended, with every token it generated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The request.
    pub request: RequestId,
    /// Its generated ids, in order.
    pub generated: Vec<u32>,
    /// Why it ended.
    pub finish: Finish,
}

/// Counts over an engine's life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Steps run.
    pub steps: usize,
    /// Tokens fed through the model: prompts, tokens computed again after a preemption, and
    /// each generated token but the last of a request.
    pub tokens_fed: usize,
    /// Sequences preempted (pages freed, computed again later).
    pub preemptions: usize,
    /// The most pages held at once.
    pub peak_pages: usize,
    /// Prompt positions mapped from another sequence's pages instead of computed.
    pub prefix_tokens_shared: usize,
}

/// A request in the engine: its tokens so far (prompt, then generated) and how many of them the
/// cache holds.
struct Sequence {
    id: RequestId,
    tokens: Vec<u32>,
    prompt_len: usize,
    computed: usize,
    request: Request,
    sampler: Sampler,
    pages: SequencePages,
}

/// A finished request's cached positions, kept as a prefix for later requests.
struct Retained {
    tokens: Vec<u32>,
    pages: SequencePages,
}

/// The key of each full page of `tokens`: a hash of its ids and the key of the page before it,
/// so equal keys at a page mean (but for a collision, which the caller rules out by comparing
/// the ids) equal prefixes up to its end.
fn page_keys(tokens: &[u32], page_size: usize) -> Vec<u64> {
    let mut key = 0u64;
    tokens
        .chunks_exact(page_size)
        .map(|page| {
            let mut hasher = DefaultHasher::new();
            (key, page).hash(&mut hasher);
            key = hasher.finish();
            key
        })
        .collect()
}

impl Sequence {
    fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Tokens not yet in the cache.
    fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }
}

/// Many requests through one [`Decoder`] at once over a page pool (continuous batching).
///
/// [`add`](Self::add) queues a request; each [`step`](Self::step) runs one ragged batch and
/// returns its events; [`cancel`](Self::cancel) ends a request at once.
pub struct Engine<'m, B: Backend> {
    model: &'m Decoder<B>,
    config: EngineConfig,
    pool: PagePool,
    storage: Vec<LayerPages<B>>,
    /// In order of arrival; a preempted sequence goes back to the front.
    waiting: VecDeque<Sequence>,
    /// In order of admission: the last is the newest.
    running: Vec<Sequence>,
    /// Finished requests' pages kept for prefixes, oldest first.
    retained: VecDeque<Retained>,
    /// Events of what happened between steps (cancellations), reported by the next step.
    pending_events: Vec<Event>,
    next_id: u64,
    stats: EngineStats,
    device: B::Device,
}

impl<'m, B: Backend> Engine<'m, B> {
    /// An engine for `model` over a pool of `config.pages` pages, each layer's storage allocated
    /// once on `device`.
    ///
    /// # Errors
    /// When a config value is out of range, or the pool's or storage's sizes are refused.
    pub fn new(
        model: &'m Decoder<B>,
        config: EngineConfig,
        device: &B::Device,
    ) -> Result<Self, EngineError> {
        if config.max_running == 0 {
            return Err(EngineError::Zero {
                field: "max_running",
            });
        }
        if config.step_tokens == 0 {
            return Err(EngineError::Zero {
                field: "step_tokens",
            });
        }
        if config.prefill_while_decoding == 0 {
            return Err(EngineError::Zero {
                field: "prefill_while_decoding",
            });
        }
        if config.step_tokens < config.max_running {
            return Err(EngineError::BudgetBelowRunning {
                step_tokens: config.step_tokens,
                max_running: config.max_running,
            });
        }
        let pool = PagePool::new(config.pages, config.page_size)?.with_kv_dtype(config.kv_dtype);
        let storage = model.new_pages(&pool)?;
        Ok(Self {
            model,
            config,
            pool,
            storage,
            waiting: VecDeque::new(),
            running: Vec::new(),
            retained: VecDeque::new(),
            pending_events: Vec::new(),
            next_id: 0,
            stats: EngineStats::default(),
            device: device.clone(),
        })
    }

    /// Bytes a page of `page_size` positions stored as `kv_dtype` takes over every layer of
    /// `model` (keys and values, with their scales): the pool's bytes are this times its pages.
    pub fn bytes_per_page(
        model: &Decoder<B>,
        page_size: usize,
        kv_dtype: KvDtype,
    ) -> Result<usize, EngineError> {
        let pool = PagePool::new(1, page_size)?.with_kv_dtype(kv_dtype);
        let storage = model.new_pages(&pool)?;
        Ok(storage
            .iter()
            .map(|layer| layer.bytes_per_position() * page_size)
            .sum())
    }

    /// Queues a request. It is checked whole here: a refused request changes nothing.
    pub fn add(&mut self, request: Request) -> Result<RequestId, RequestError> {
        self.check(&request)?;
        let sampler = Sampler::new(&request.sampling)?;
        let id = RequestId(self.next_id);
        self.next_id += 1;
        self.waiting.push_back(Sequence {
            id,
            tokens: request.ids.clone(),
            prompt_len: request.ids.len(),
            computed: 0,
            request,
            sampler,
            pages: self.model.new_sequence(),
        });
        Ok(id)
    }

    fn check(&self, request: &Request) -> Result<(), RequestError> {
        let vocab_size = self.model.vocab_size();
        if request.ids.is_empty() {
            return Err(RequestError::EmptyPrompt);
        }
        if request.max_new_tokens == 0 {
            return Err(RequestError::NoNewTokens);
        }
        if let Some(position) = request.ids.iter().position(|&id| id as usize >= vocab_size) {
            return Err(RequestError::PromptId {
                position,
                id: request.ids[position],
                vocab_size,
            });
        }
        if let Some(&id) = request
            .stop_ids
            .iter()
            .find(|&&id| id as usize >= vocab_size)
        {
            return Err(RequestError::StopId { id, vocab_size });
        }
        let context_length = self.model.context_length();
        if request.ids.len() + request.max_new_tokens > context_length {
            return Err(RequestError::PastContext {
                prompt: request.ids.len(),
                max_new_tokens: request.max_new_tokens,
                context_length,
            });
        }
        request.sampling.validate()?;
        // The last generated token is never fed. A windowed kind holds no more than its window
        // and a step's tokens.
        let positions = request.ids.len() + request.max_new_tokens - 1;
        let needed = self
            .model
            .attention_kinds()
            .into_iter()
            .map(|window| match window {
                // A window not on a page's edge may straddle one more page.
                Some(window) if window + self.config.step_tokens < positions => {
                    self.pool.pages_for(window + self.config.step_tokens) + 1
                }
                _ => self.pool.pages_for(positions),
            })
            .sum::<usize>();
        if needed > self.pool.pages() {
            return Err(RequestError::LargerThanPool {
                needed,
                pages: self.pool.pages(),
            });
        }
        Ok(())
    }

    /// Ends a waiting or running request now, freeing its pages; its
    /// [`Finish::Cancelled`] comes with the next step's events. False when no such request is in
    /// the engine (it ended, or never was).
    pub fn cancel(&mut self, request: RequestId) -> bool {
        let sequence = if let Some(index) = self.waiting.iter().position(|s| s.id == request) {
            self.waiting.remove(index)
        } else if let Some(index) = self.running.iter().position(|s| s.id == request) {
            Some(self.running.remove(index))
        } else {
            None
        };
        let Some(mut sequence) = sequence else {
            return false;
        };
        sequence.pages.release(&mut self.pool);
        self.pending_events.push(Event::Finished {
            request,
            finish: Finish::Cancelled,
        });
        true
    }

    /// Whether no request waits or runs and no event is left to report.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.pending_events.is_empty()
    }

    /// Requests waiting to be admitted (preempted ones included).
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests admitted and running.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// The page pool (pages held and free).
    pub fn pool(&self) -> &PagePool {
        &self.pool
    }

    /// Counts so far.
    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    /// One step: admits what fits, feeds every running sequence's next chunk in one ragged
    /// batch, picks the next token of each sequence whose chunk reached its last token, and ends
    /// the requests that are done. Returns the step's events (none when the engine is idle).
    ///
    /// # Errors
    /// What the model refuses; the step's sequences are then left as they were before it, their
    /// reserved positions included, so the engine should not be stepped again.
    pub fn step(&mut self) -> Result<Vec<Event>, DecoderError> {
        let mut events = std::mem::take(&mut self.pending_events);
        let plan = self.plan()?;
        if plan.is_empty() {
            if let Some(front) = self.waiting.front() {
                // Nothing runs and the first in line does not fit the whole pool: `add` refuses
                // such a request, so only a bug gets here; an error, not a loop.
                let new = front.pending().min(self.config.step_tokens);
                let needed = self
                    .model
                    .pages_needed(&self.pool, &[(&front.pages, new)])?;
                return Err(AttentionError::OutOfPages {
                    needed,
                    free: self.pool.free_pages(),
                }
                .into());
            }
            return Ok(events);
        }
        let fed: Vec<i64> = plan
            .iter()
            .zip(&self.running)
            .flat_map(|(&new, sequence)| {
                sequence.tokens[sequence.computed..sequence.computed + new]
                    .iter()
                    .map(|&id| i64::from(id))
            })
            .collect();
        let count = fed.len();
        let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(fed, [1, count]), &self.device);
        let mut reserved: Vec<(&mut SequencePages, usize)> = self
            .running
            .iter_mut()
            .zip(&plan)
            .map(|(sequence, &new)| (&mut sequence.pages, new))
            .collect();
        let steps = self.model.reserve(&mut self.pool, &mut reserved)?;
        self.stats.steps += 1;
        self.stats.tokens_fed += count;
        self.stats.peak_pages = self
            .stats
            .peak_pages
            .max(self.pool.pages() - self.pool.free_pages());
        // [sequences, vocab]: each sequence's last fed token's logits.
        let logits = self
            .model
            .forward_paged(tokens, &steps, &mut self.storage, Logits::Last)?
            .squeeze_dim::<2>(0);
        for (sequence, &new) in self.running.iter_mut().zip(&plan) {
            sequence.computed += new;
        }
        let picked = self.pick(logits);
        let mut ended = Vec::new();
        for (index, id) in picked {
            let sequence = &mut self.running[index];
            sequence.tokens.push(id);
            events.push(Event::Token {
                request: sequence.id,
                id,
            });
            let finish = if sequence.request.stop_ids.contains(&id) {
                Some(Finish::Stop)
            } else if sequence.generated().len() == sequence.request.max_new_tokens {
                Some(Finish::Length)
            } else {
                None
            };
            if let Some(finish) = finish {
                ended.push(index);
                events.push(Event::Finished {
                    request: sequence.id,
                    finish,
                });
            }
        }
        for index in ended.into_iter().rev() {
            let sequence = self.running.remove(index);
            self.retain(sequence);
        }
        Ok(events)
    }

    /// Keeps a finished sequence's pages for later prefixes, within `retain_pages` (the oldest
    /// let go first), or lets them go.
    fn retain(&mut self, mut sequence: Sequence) {
        if !self.config.share_prefixes || self.config.retain_pages == 0 {
            sequence.pages.release(&mut self.pool);
            return;
        }
        sequence.tokens.truncate(sequence.computed);
        self.retained.push_back(Retained {
            tokens: sequence.tokens,
            pages: sequence.pages,
        });
        while self.retained_pages() > self.config.retain_pages && self.evict_oldest() {}
    }

    fn retained_pages(&self) -> usize {
        self.retained.iter().map(|r| r.pages.pages_held()).sum()
    }

    /// Lets go of the oldest retained prefix; false when none is kept.
    fn evict_oldest(&mut self) -> bool {
        let Some(mut oldest) = self.retained.pop_front() else {
            return false;
        };
        oldest.pages.release(&mut self.pool);
        true
    }

    /// Lets go of every retained prefix: with nothing running, the pool is whole afterwards.
    pub fn forget_prefixes(&mut self) {
        while self.evict_oldest() {}
    }

    /// Maps the longest run of whole pages that `sequence`'s tokens share with a running or
    /// retained sequence's computed positions (found by page keys, confirmed by comparing the
    /// ids), leaving at least its last token to compute. A prefix a windowed attention kind has
    /// already let go of is not shared.
    fn share_prefix(&mut self, sequence: &mut Sequence) {
        let page_size = self.config.page_size;
        if !self.config.share_prefixes || sequence.computed > 0 {
            return;
        }
        let usable = (sequence.tokens.len() - 1) / page_size * page_size;
        let keys = page_keys(&sequence.tokens[..usable], page_size);
        if keys.is_empty() {
            return;
        }
        let sources = self
            .running
            .iter()
            .map(|s| (&s.tokens[..s.computed], &s.pages))
            .chain(self.retained.iter().map(|r| (&r.tokens[..], &r.pages)));
        let mut best: Option<(usize, &SequencePages)> = None;
        for (tokens, pages) in sources {
            let theirs = page_keys(tokens, page_size);
            let pages_equal = keys.iter().zip(&theirs).take_while(|(a, b)| a == b).count();
            let positions = pages_equal * page_size;
            let confirmed = tokens[..positions] == sequence.tokens[..positions];
            if confirmed && positions > best.map_or(0, |(p, _)| p) {
                best = Some((positions, pages));
            }
        }
        if let Some((positions, pages)) = best
            && let Ok(shared) = pages.share(&mut self.pool, positions)
        {
            sequence.pages = shared;
            sequence.computed = positions;
            self.stats.prefix_tokens_shared += positions;
        }
    }

    /// Each running sequence's tokens this step, admitting waiting requests and preempting
    /// running ones to make it fit: the step feeds `plan[i]` tokens of `running[i]`, at least
    /// one each. Every running sequence gets its first token before any gets a second (the
    /// budget is at least `max_running`), so a prompt chunk never stalls a decoding row; beside
    /// `d` decoding rows, chunks take at most `max(d, prefill_while_decoding)` tokens.
    fn plan(&mut self) -> Result<Vec<usize>, DecoderError> {
        loop {
            let mut plan = vec![1; self.running.len()];
            let mut budget = self.config.step_tokens - self.running.len();
            let decoding = self.running.iter().filter(|s| s.pending() == 1).count();
            if decoding > 0 {
                // Each running prompt's first token this step is a prompt token too.
                let prompts = self.running.len() - decoding;
                let cap = self.config.prefill_while_decoding.max(decoding);
                budget = budget.min(cap.saturating_sub(prompts));
            }
            for (new, sequence) in plan.iter_mut().zip(&self.running) {
                let more = (sequence.pending() - 1).min(budget);
                *new += more;
                budget -= more;
            }
            if self.pages_needed(&plan)? <= self.pool.free_pages() {
                self.admit(&mut plan, budget)?;
                return Ok(plan);
            }
            // Retained prefixes go before any running sequence.
            if self.evict_oldest() {
                continue;
            }
            // The running sequences' step does not fit: the newest gives its pages back and
            // waits, first in line, to be computed again.
            let mut newest = self.running.pop().expect("an empty step needs no pages");
            newest.pages.release(&mut self.pool);
            newest.computed = 0;
            self.stats.preemptions += 1;
            self.waiting.push_front(newest);
        }
    }

    /// Admits waiting requests in order while the step has budget, room and pages.
    fn admit(&mut self, plan: &mut Vec<usize>, mut budget: usize) -> Result<(), DecoderError> {
        while budget > 0 && self.running.len() < self.config.max_running {
            let Some(mut next) = self.waiting.pop_front() else {
                break;
            };
            self.share_prefix(&mut next);
            let new = next.pending().min(budget);
            self.running.push(next);
            plan.push(new);
            let mut needed = self.pages_needed(plan)?;
            while needed > self.pool.free_pages() && self.evict_oldest() {
                needed = self.pages_needed(plan)?;
            }
            if needed > self.pool.free_pages() {
                plan.pop();
                // It waits without pages: a waiting sequence holds none.
                let mut back = self.running.pop().expect("just admitted");
                back.pages.release(&mut self.pool);
                back.computed = 0;
                self.waiting.push_front(back);
                break;
            }
            budget -= new;
        }
        Ok(())
    }

    fn pages_needed(&self, plan: &[usize]) -> Result<usize, DecoderError> {
        let sequences: Vec<(&SequencePages, usize)> = self
            .running
            .iter()
            .zip(plan)
            .map(|(sequence, &new)| (&sequence.pages, new))
            .collect();
        self.model.pages_needed(&self.pool, &sequences)
    }

    /// The next token of every sequence whose chunk reached its last token, chosen on the
    /// device: greedy rows with one `argmax`, each sampled row by its own request's sampler.
    /// Only the ids come back. Returns `(index in running, id)` in running order.
    ///
    /// # Shapes
    /// - `logits`: `[sequences fed, vocab]`
    fn pick(&mut self, logits: Tensor<B, 2>) -> Vec<(usize, u32)> {
        let done: Vec<usize> = (0..logits.dims()[0])
            .filter(|&index| self.running[index].pending() == 0)
            .collect();
        let rows = |indices: &[usize], device: &B::Device| {
            let indices: Vec<i64> = indices.iter().map(|&index| index as i64).collect();
            let count = indices.len();
            Tensor::<B, 1, Int>::from_data(TensorData::new(indices, [count]), device)
        };
        let (greedy, sampled): (Vec<usize>, Vec<usize>) = done
            .iter()
            .partition(|&&index| self.running[index].request.sampling == Sampling::Greedy);
        let mut picked = Vec::with_capacity(done.len());
        if !greedy.is_empty() {
            let ids = logits
                .clone()
                .select(0, rows(&greedy, &self.device))
                .argmax(1)
                .into_data()
                .convert::<i64>()
                .into_vec::<i64>()
                .expect("integer ids");
            picked.extend(
                greedy
                    .iter()
                    .zip(ids)
                    .map(|(&index, id)| (index, id as u32)),
            );
        }
        for index in sampled {
            let row = logits.clone().select(0, rows(&[index], &self.device));
            let [id] = <[usize; 1]>::try_from(self.running[index].sampler.pick_rows(row))
                .expect("one row");
            picked.push((index, id as u32));
        }
        picked.sort_unstable_by_key(|&(index, _)| index);
        picked
    }

    /// Steps until every request has ended; returns each one's tokens, in the order they ended.
    pub fn run_to_end(&mut self) -> Result<Vec<Completion>, DecoderError> {
        let mut generated: Vec<(RequestId, Vec<u32>)> = Vec::new();
        let mut completions = Vec::new();
        while !self.is_idle() {
            for event in self.step()? {
                match event {
                    Event::Token { request, id } => {
                        match generated.iter_mut().find(|(r, _)| *r == request) {
                            Some((_, ids)) => ids.push(id),
                            None => generated.push((request, vec![id])),
                        }
                    }
                    Event::Finished { request, finish } => {
                        let ids = generated
                            .iter()
                            .position(|(r, _)| *r == request)
                            .map(|index| generated.swap_remove(index).1)
                            .unwrap_or_default();
                        completions.push(Completion {
                            request,
                            generated: ids,
                            finish,
                        });
                    }
                }
            }
        }
        Ok(completions)
    }
}
