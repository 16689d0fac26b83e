//! A module's float parameters by dotted path (`blocks.0.attention.query_layer.weight`), the
//! names Burn's `Module` derive gives them: out of a module, and back into one.

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
        path: Vec<String>,
        with_data: bool,
        found: Vec<(String, Vec<usize>, Option<TensorData>)>,
    }
    impl<B: Backend> ModuleVisitor<B> for Collect {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let tensor = param.val();
            let shape = tensor.dims().to_vec();
            let data = self.with_data.then(|| tensor.into_data());
            self.found.push((self.path.join("."), shape, data));
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
        path: Vec<String>,
        tensors: &'a mut BTreeMap<String, TensorData>,
        unmatched: Vec<String>,
    }
    impl<B: Backend> ModuleMapper<B> for Load<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let path = self.path.join(".");
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
