//! `--requests FILE.jsonl`: many requests through one model at once (continuous batching over
//! a page pool), one request a line, each result a JSON line on stdout as it finishes.
//!
//! A line: `ids` (token ids) or `prompt` (text, with the `tokenizer` feature), and optionally
//! `id`, `max_new_tokens` (else `--new-tokens`), `temperature`, `top_k`, `top_p`, `seed`,
//! `stop_ids` (else the model's end-of-sequence ids; `[]` for none). A result: `id` (the line's,
//! or its line number from 0), `generated`, `text` (with a tokenizer), `finish` (`length`,
//! `stop`, or `error` with a `message` and the `line`'s number), `ttft_s` (from the start to its first token) and
//! `tokens_per_s` (its tokens over its time from the start). A bad line is an error line for
//! that request alone; the others go on.

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

use burn::prelude::*;
use hf_models::{CausalLm, Engine, EngineConfig, Event, Finish, Request, RequestId, Sampling};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::{Cli, CliError};

/// One line of the requests file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    id: Option<Value>,
    ids: Option<Vec<u32>>,
    prompt: Option<String>,
    max_new_tokens: Option<usize>,
    temperature: Option<f64>,
    top_k: Option<usize>,
    top_p: Option<f64>,
    seed: Option<u64>,
    stop_ids: Option<Vec<u32>>,
}

/// A request in flight: what its result line needs.
struct Pending {
    id: Value,
    first_token: Option<f64>,
    generated: Vec<u32>,
}

/// Runs every request of `path`; returns whether all of them succeeded.
pub fn run<B: Backend>(cli: &Cli, path: &Path, device: &B::Device) -> Result<bool, CliError> {
    let bytes = tensor_files::read_bytes(path)?;
    let model = CausalLm::<B>::load(&cli.model, device)?;
    let texts = crate::text::Texts::load(&cli.model)?;
    let bytes_per_page = Engine::bytes_per_page(model.decoder(), cli.page_size, cli.kv_dtype)
        .map_err(|e| CliError::Input(format!("--page-size: {e}")))?;
    let pages = (cli.kv_mib << 20) / bytes_per_page;
    let config = EngineConfig::new(pages)
        .with_page_size(cli.page_size)
        .with_max_running(cli.max_running)
        .with_step_tokens(cli.step_tokens)
        .with_kv_dtype(cli.kv_dtype);
    let config = match cli.prefill_while_decoding {
        Some(tokens) => config.with_prefill_while_decoding(tokens),
        None => config,
    };
    let mut engine = Engine::new(model.decoder(), config, device)
        .map_err(|e| CliError::Input(format!("the engine's settings: {e}")))?;

    let start = Instant::now();
    let mut out = std::io::stdout().lock();
    let mut print = |line: Value| -> Result<(), CliError> {
        writeln!(out, "{line}")
            .and_then(|()| out.flush())
            .map_err(|e| CliError::Input(format!("cannot write the results: {e}")))
    };
    let mut all_ok = true;
    let mut seen = HashSet::new();
    let mut pending: Vec<(RequestId, Pending)> = Vec::new();
    for (number, line) in lines(&bytes).enumerate() {
        let fallback = Value::from(number);
        let (id, request) = match read_line(line) {
            Ok(line) => (
                line.id.clone().unwrap_or(fallback),
                request(line, cli, &model, &texts),
            ),
            Err(message) => (fallback, Err(message)),
        };
        let added = request.and_then(|request| {
            if !seen.insert(id.to_string()) {
                return Err(format!("a second request with id {id}"));
            }
            engine.add(request).map_err(|e| e.to_string())
        });
        match added {
            Ok(handle) => pending.push((
                handle,
                Pending {
                    id,
                    first_token: None,
                    generated: Vec::new(),
                },
            )),
            Err(message) => {
                all_ok = false;
                print(json!({"id": id, "line": number, "finish": "error", "message": message}))?;
            }
        }
    }

    while !engine.is_idle() {
        let events = engine
            .step()
            .map_err(|e| CliError::Input(format!("a step of the requests failed: {e}")))?;
        for event in events {
            match event {
                Event::Token { request, id } => {
                    let (_, state) = pending
                        .iter_mut()
                        .find(|(handle, _)| *handle == request)
                        .expect("a request of this run");
                    state
                        .first_token
                        .get_or_insert_with(|| start.elapsed().as_secs_f64());
                    state.generated.push(id);
                }
                Event::Finished { request, finish } => {
                    let index = pending
                        .iter()
                        .position(|(handle, _)| *handle == request)
                        .expect("a request of this run");
                    let (_, done) = pending.swap_remove(index);
                    let seconds = start.elapsed().as_secs_f64();
                    let finish = match finish {
                        Finish::Length => "length",
                        Finish::Stop => "stop",
                        Finish::Cancelled => "cancelled",
                    };
                    let mut line = json!({
                        "id": done.id,
                        "generated": done.generated,
                        "finish": finish,
                        "ttft_s": done.first_token,
                        "tokens_per_s": done.generated.len() as f64 / seconds,
                    });
                    if let Some(text) = texts.decode(&done.generated) {
                        line["text"] = Value::from(text);
                    }
                    print(line)?;
                }
            }
        }
    }
    Ok(all_ok)
}

/// The file's lines, numbered as a user counts them from 0: a final newline ends the last line
/// rather than starting an empty one; an empty line is a line (an error line of its own).
fn lines(bytes: &[u8]) -> impl Iterator<Item = &[u8]> {
    let body = bytes.strip_suffix(b"\n").unwrap_or(bytes);
    let lines = if body.is_empty() && bytes.len() <= 1 {
        None
    } else {
        Some(body.split(|&byte| byte == b'\n'))
    };
    lines.into_iter().flatten()
}

/// A line's fields, or the message of its error line.
fn read_line(line: &[u8]) -> Result<Line, String> {
    let line = std::str::from_utf8(line).map_err(|e| format!("the line is not UTF-8: {e}"))?;
    serde_json::from_str(line).map_err(|e| format!("the line is not a request: {e}"))
}

/// A line's request, or the message of its error line.
fn request<B: Backend>(
    line: Line,
    cli: &Cli,
    model: &CausalLm<B>,
    texts: &crate::text::Texts,
) -> Result<Request, String> {
    let ids = match (line.ids, line.prompt) {
        (Some(ids), None) => ids,
        (None, Some(prompt)) => texts.encode(&prompt)?,
        (Some(_), Some(_)) => return Err("both `ids` and `prompt`: give one".into()),
        (None, None) => return Err("neither `ids` nor `prompt`: give one".into()),
    };
    let sampling = match line.temperature {
        None if line.top_k.is_some() || line.top_p.is_some() || line.seed.is_some() => {
            return Err("`top_k`, `top_p` and `seed` need a `temperature`".into());
        }
        None => Sampling::Greedy,
        Some(temperature) => Sampling::Sample {
            temperature,
            top_k: line.top_k,
            top_p: line.top_p,
            seed: line.seed.unwrap_or(0),
        },
    };
    let request = Request {
        ids,
        max_new_tokens: line.max_new_tokens.unwrap_or(cli.new_tokens),
        sampling,
        stop_ids: line
            .stop_ids
            .unwrap_or_else(|| model.special_tokens().eos.clone()),
    };
    Ok(request)
}
