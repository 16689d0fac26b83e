//! `cargo bench -p attention-bench`: every backend × implementation × mode at the tracked shapes,
//! grouped as `backend/impl/mode/shape`. The large shapes take minutes each on a small CPU:
//! filter, e.g. `cargo bench -p attention-bench -- 'flex/fused/fwd'`.

use attention_backends::{BackendName, OnBackend, dispatch};
use attention_bench::{Impl, Mode, STANDARD_SHAPES, Shape, Timed, prepare};
use burn::prelude::*;
use criterion::{Criterion, criterion_group, criterion_main};

const IMPLS: [Impl; 3] = [Impl::Explicit, Impl::Fused, Impl::BurnNn];
const MODES: [Mode; 3] = [Mode::Fwd, Mode::Fwdbwd, Mode::Decode];

/// Every implementation × mode × shape on one backend.
struct Suite<'a>(&'a mut Criterion);

impl OnBackend for Suite<'_> {
    type Output = ();

    fn run<B: Backend>(self, name: &'static str, device: B::Device) {
        backend::<B>(self.0, name, &device);
    }
}

fn backend<B: Backend>(c: &mut Criterion, name: &str, device: &B::Device) {
    for implementation in IMPLS {
        for mode in MODES {
            let mut group =
                c.benchmark_group(format!("{name}/{}/{}", implementation.name(), mode.name()));
            group.sample_size(10);
            for shape in STANDARD_SHAPES {
                let shape: Shape = shape.parse().expect("standard shape");
                let timed = Timed {
                    implementation,
                    mode,
                    shape,
                    calls: 1,
                    documents: None,
                    decode: Default::default(),
                };
                // Unsupported combinations (burn-nn has no cached decode) are left out. A case is
                // prepared only when criterion runs it, so a filtered run prepares only its cases.
                if timed.supported().is_ok() {
                    group.bench_function(shape.to_string(), |b| {
                        let mut case = prepare::<B>(timed.clone(), device).expect("supported");
                        b.iter(|| case.iteration())
                    });
                }
            }
            group.finish();
        }
    }
}

fn all_backends(c: &mut Criterion) {
    for backend in BackendName::ALL {
        if let Err(no_adapter) = dispatch(backend, Suite(c)) {
            eprintln!("{} skipped: {no_adapter}", backend.name());
        }
    }
}

criterion_group!(benches, all_backends);
criterion_main!(benches);
