//! A module's float parameters by dotted path (`blocks.0.attention.query_layer.weight`), the
//! names Burn's `Module` derive gives them: out of a module, and back into one.
//!
//! An enum module's variant is left out of the path: a [`Norm`](crate::Norm) in the field
//! `attention_norm` has its scale at `attention_norm.gamma` whether it is a LayerNorm or an
//! RMSNorm (which one is the config's to say), as it had when the book's GPT held a `LayerNorm`
//! there: checkpoints written before the decoder had enum parts keep loading.

use std::collections::BTreeMap;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::prelude::*;

/// Every float parameter of `module` with its path and shape, in visiting order.
pub fn parameter_shapes<B: Backend, M: Module<B>>(module: &M) -> Vec<(String, Vec<usize>)> {
    visit_parameters(module, false)
        .into_iter()
        .map(|(path, shape, _)| (path, shape))
        .collect()
}

/// Every float parameter of `module` with its path, as data.
pub fn named_parameters<B: Backend, M: Module<B>>(module: &M) -> Vec<(String, TensorData)> {
    visit_parameters(module, true)
        .into_iter()
        .map(|(path, _, data)| (path, data.expect("read with data")))
        .collect()
}

/// Every float parameter's path and shape, and its data when `with_data`.
fn visit_parameters<B: Backend, M: Module<B>>(
    module: &M,
    with_data: bool,
) -> Vec<(String, Vec<usize>, Option<TensorData>)> {
    struct Collect {
        path: Vec<Option<String>>,
        with_data: bool,
        found: Vec<(String, Vec<usize>, Option<TensorData>)>,
    }
    impl<B: Backend> ModuleVisitor<B> for Collect {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            self.path.push(component(name, container_type));
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let tensor = param.val();
            let shape = tensor.dims().to_vec();
            let data = self.with_data.then(|| tensor.into_data());
            self.found.push((join(&self.path), shape, data));
        }
    }
    let mut collect = Collect {
        path: Vec::new(),
        with_data,
        found: Vec::new(),
    };
    module.visit(&mut collect);
    collect.found
}

/// `module` with each float parameter replaced by the tensor of its path in `tensors` (removed
/// from it). The caller has checked names and shapes; a parameter without a tensor, or with one
/// of another shape, keeps its value and is returned in the error list.
pub fn load_parameters<B: Backend, M: Module<B>>(
    module: M,
    tensors: &mut BTreeMap<String, TensorData>,
) -> (M, Vec<String>) {
    struct Load<'a> {
        path: Vec<Option<String>>,
        tensors: &'a mut BTreeMap<String, TensorData>,
        unmatched: Vec<String>,
    }
    impl<B: Backend> ModuleMapper<B> for Load<'_> {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            self.path.push(component(name, container_type));
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let path = join(&self.path);
            let tensor = match self.tensors.remove(&path) {
                Some(data) if data.shape.as_slice() == tensor.dims().as_slice() => {
                    Tensor::from_data(data.convert::<B::FloatElem>(), &tensor.device())
                }
                _ => {
                    self.unmatched.push(path);
                    tensor
                }
            };
            Param::from_mapped_value(id, tensor, mapper)
        }
    }
    let mut load = Load {
        path: Vec::new(),
        tensors,
        unmatched: Vec::new(),
    };
    let module = module.map(&mut load);
    (module, load.unmatched)
}

/// The dotted path of the components entered so far.
fn join(path: &[Option<String>]) -> String {
    path.iter()
        .flatten()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(".")
}

/// The path component a module entered through `enter_module` adds: its field name or index,
/// nothing for an enum's variant (Burn names the container `"Enum:TypeName"`).
fn component(name: &str, container_type: &str) -> Option<String> {
    (!container_type.starts_with("Enum:")).then(|| name.to_string())
}
