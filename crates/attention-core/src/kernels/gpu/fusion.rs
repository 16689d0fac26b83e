//! [`FlashBackend`] on Burn's fusion backend (`Wgpu` is `Fusion<CubeBackend<…>>`).
//!
//! A fusion tensor is a handle to a value its stream has not necessarily computed yet, so the
//! kernel cannot be launched on the spot: each call registers one custom operation in the
//! stream (`OperationIr::Custom`, as burn-vision does for its own kernels), and the stream runs
//! it on the inner backend's tensors, in order with the operations around it. The alternative —
//! resolving the inputs to the inner backend's tensors and wrapping the outputs back — would
//! flush the stream at every call.

use std::marker::PhantomData;

use burn::prelude::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Shape};
use burn_fusion::client::GlobalFusionClient;
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime, FusionTensor};
use burn_ir::{BackendIr, CustomOpIr, HandleContainer, OperationIr, OperationOutput, TensorIr};

use super::simt::Tiling;
use super::{FlashBackend, FlashCall, FlashGradInputs, FlashTensors, KvTensors, PagedLaunch};

impl<B: FusionBackend + FlashBackend> FlashBackend for Fusion<B> {
    fn flash_forward(
        tensors: FlashTensors<Self>,
        sinks: Option<FloatTensor<Self>>,
        call: FlashCall,
    ) -> [FloatTensor<Self>; 2] {
        let dtype = tensors.query.dtype;
        let pass = Pass::Forward {
            given: Given::of(&tensors),
            has_sinks: sinks.is_some(),
        };
        // Shaped as the query: `[batch, queries, ·]`, or a ragged step's `[1, tokens, ·]`.
        let [batch, queries] = [0, 1].map(|dim| tensors.query.shape[dim]);
        let inputs = inputs(tensors).chain(sinks).collect();
        let outputs = [
            (
                Shape::new([batch, queries, call.heads * call.head_dim]),
                dtype,
            ),
            (Shape::new([batch, queries, call.heads]), DType::F32),
        ];
        registered::<B, 2>(pass, call, inputs, outputs)
    }

    fn flash_backward(
        tensors: FlashTensors<Self>,
        grads: FlashGradInputs<Self>,
        call: FlashCall,
    ) -> [FloatTensor<Self>; 3] {
        let pass = Pass::Backward {
            given: Given::of(&tensors),
        };
        let [key, value] = tensors.kv.float();
        let shapes =
            [&tensors.query, key, value].map(|tensor| (tensor.shape.clone(), tensor.dtype));
        let inputs = inputs(tensors)
            .chain([grads.output_grad, grads.lse, grads.delta])
            .collect();
        registered::<B, 3>(pass, call, inputs, shapes)
    }

    fn forward_tiling(device: &Self::Device, call: &FlashCall, dtype: DType) -> Tiling {
        B::forward_tiling(device, call, dtype)
    }

    fn end_step(device: &Self::Device) {
        // The stream's queued operations are optimized and launched now (the host waits for
        // that, not for the device): see `op::end_step`.
        GlobalFusionClient::<B::FusionRuntime>::load(device).sync(|| ());
    }
}

/// The query, keys and values (key, value; or an int8 cache's key and value words, then their
/// scales), padding, documents, and a ragged step's tables and work list, in the order the
/// operation reads them.
fn inputs<R: FusionRuntime, B: FusionBackend<FusionRuntime = R>>(
    tensors: FlashTensors<Fusion<B>>,
) -> impl Iterator<Item = FusionTensor<R>> {
    let kv: Vec<FusionTensor<R>> = match tensors.kv {
        KvTensors::Float { key, value } => vec![key, value],
        KvTensors::Int8 { words, scales } => words.into_iter().chain(scales).collect(),
    };
    std::iter::once(tensors.query)
        .chain(kv)
        .chain(tensors.key_padding)
        .chain(tensors.documents)
        .chain(
            tensors
                .pages
                .into_iter()
                .flat_map(|pages| [pages.tables, pages.work]),
        )
}

/// Which of [`FlashTensors`]' optional tensors a call was given.
#[derive(Debug, Clone, Copy)]
struct Given {
    /// The keys and values are an int8 cache's words and scales.
    int8: bool,
    padding: bool,
    documents: bool,
    pages: bool,
}

impl Given {
    fn of<B: Backend>(tensors: &FlashTensors<B>) -> Self {
        Self {
            int8: matches!(tensors.kv, KvTensors::Int8 { .. }),
            padding: tensors.key_padding.is_some(),
            documents: tensors.documents.is_some(),
            pages: tensors.pages.is_some(),
        }
    }
}

/// Which kernel call an operation makes, and which optional inputs it was given.
#[derive(Debug, Clone, Copy)]
enum Pass {
    /// Inputs: query, key, value (an int8 cache: key words, value words, key scales, value
    /// scales), [padding], [documents], [tables, work list], [sinks]; outputs: output, lse.
    Forward { given: Given, has_sinks: bool },
    /// Inputs: query, key, value, [padding], [documents], output gradient, lse, delta;
    /// outputs: the query, key and value gradients.
    Backward { given: Given },
}

/// One flash-attention call in a fusion stream.
#[derive(Debug)]
struct FlashOperation<B> {
    desc: CustomOpIr,
    pass: Pass,
    call: FlashCall,
    backend: PhantomData<B>,
}

impl<B: FusionBackend + FlashBackend> Operation<B::FusionRuntime> for FlashOperation<B> {
    fn execute(
        &self,
        handles: &mut HandleContainer<<B::FusionRuntime as FusionRuntime>::FusionHandle>,
    ) {
        let mut inputs = Inputs {
            irs: self.desc.inputs.iter(),
            handles,
        };
        let given = match self.pass {
            Pass::Forward { given, .. } | Pass::Backward { given } => given,
        };
        // In the order `inputs` registered them.
        let query = inputs.float::<B>();
        let kv = match given.int8 {
            true => {
                let words = [inputs.int::<B>(), inputs.int::<B>()];
                let scales = [inputs.float::<B>(), inputs.float::<B>()];
                KvTensors::Int8 { words, scales }
            }
            false => KvTensors::Float {
                key: inputs.float::<B>(),
                value: inputs.float::<B>(),
            },
        };
        let tensors = FlashTensors::<B> {
            query,
            kv,
            key_padding: given.padding.then(|| inputs.float::<B>()),
            documents: given.documents.then(|| inputs.float::<B>()),
            pages: given.pages.then(|| PagedLaunch {
                tables: inputs.int::<B>(),
                work: inputs.int::<B>(),
            }),
        };
        let outputs: Vec<FloatTensor<B>> = match self.pass {
            Pass::Forward { has_sinks, .. } => {
                let sinks = has_sinks.then(|| inputs.float::<B>());
                B::flash_forward(tensors, sinks, self.call).into()
            }
            Pass::Backward { .. } => {
                let grads = FlashGradInputs {
                    output_grad: inputs.float::<B>(),
                    lse: inputs.float::<B>(),
                    delta: inputs.float::<B>(),
                };
                B::flash_backward(tensors, grads, self.call).into()
            }
        };
        let handles = inputs.handles;
        for (ir, tensor) in self.desc.outputs.iter().zip(outputs) {
            handles.register_float_tensor::<B>(&ir.id, tensor);
        }
    }
}

/// An operation's inputs as its stream holds them, taken in the order they were registered.
struct Inputs<'a, H> {
    irs: std::slice::Iter<'a, TensorIr>,
    handles: &'a mut HandleContainer<H>,
}

impl<H: Clone> Inputs<'_, H> {
    fn next_ir(&mut self) -> TensorIr {
        self.irs
            .next()
            .expect("the operation was registered with it")
            .clone()
    }

    /// The next input, a float tensor.
    fn float<B: BackendIr<Handle = H>>(&mut self) -> FloatTensor<B> {
        let ir = self.next_ir();
        self.handles.get_float_tensor::<B>(&ir)
    }

    /// The next input, an integer tensor (an int8 cache's words, a ragged step's tables and work
    /// list).
    fn int<B: BackendIr<Handle = H>>(&mut self) -> IntTensor<B> {
        let ir = self.next_ir();
        self.handles.get_int_tensor::<B>(&ir)
    }
}

/// Registers `pass` over `inputs` in their stream; returns its `N` outputs of the given shapes
/// and types.
fn registered<B: FusionBackend + FlashBackend, const N: usize>(
    pass: Pass,
    call: FlashCall,
    inputs: Vec<FusionTensor<B::FusionRuntime>>,
    outputs: [(Shape, DType); N],
) -> [FusionTensor<B::FusionRuntime>; N] {
    let client = inputs[0].client.clone();
    let streams = OperationStreams::with_inputs(&inputs);
    let outputs =
        outputs.map(|(shape, dtype)| TensorIr::uninit(client.create_empty_handle(), shape, dtype));
    let inputs: Vec<TensorIr> = inputs.into_iter().map(FusionTensor::into_ir).collect();
    let desc = CustomOpIr::new("attention-core flash attention", &inputs, &outputs);
    client
        .register(
            streams,
            OperationIr::Custom(desc.clone()),
            FlashOperation::<B> {
                desc,
                pass,
                call,
                backend: PhantomData,
            },
        )
        .outputs::<N>()
}
