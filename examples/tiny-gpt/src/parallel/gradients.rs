//! A step's gradients flattened into one vector, in the order the model visits its parameters,
//! and the averaged vector put back as gradients.

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;

/// Takes every parameter's gradient out of `grads`, flattened, in the order `model` visits its
/// parameters (zeros for a parameter without a gradient).
pub(super) fn flatten<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    grads: &mut GradientsParams,
    device: &B::Device,
) -> Vec<Tensor<B::InnerBackend, 1>> {
    let mut visitor = Flatten::<B> {
        grads,
        parts: Vec::new(),
        device: device.clone(),
    };
    model.visit(&mut visitor);
    visitor.parts
}

/// Puts `mean`, laid out as [`flatten`] took the gradients, back into `grads`.
pub(super) fn unflatten<B: AutodiffBackend, M: AutodiffModule<B>>(
    model: &M,
    mean: Tensor<B::InnerBackend, 1>,
    grads: &mut GradientsParams,
) {
    model.visit(&mut Unflatten::<B> {
        mean,
        offset: 0,
        grads,
    });
}

/// Takes a step's gradients out of `grads` into flat parts, in the model's parameter order.
struct Flatten<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    parts: Vec<Tensor<B::InnerBackend, 1>>,
    device: B::Device,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Flatten<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let grad = self
            .grads
            .remove::<B::InnerBackend, D>(param.id)
            .unwrap_or_else(|| Tensor::zeros(param.val().shape(), &self.device));
        self.parts.push(grad.reshape([-1]));
    }
}

/// Puts the averaged gradients back into `grads`, in the order [`Flatten`] took them.
struct Unflatten<'a, B: AutodiffBackend> {
    mean: Tensor<B::InnerBackend, 1>,
    offset: usize,
    grads: &'a mut GradientsParams,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Unflatten<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let shape = param.val().shape();
        let length = shape.num_elements();
        let grad = self
            .mean
            .clone()
            .narrow(0, self.offset, length)
            .reshape(shape);
        self.grads.register::<B::InnerBackend, D>(param.id, grad);
        self.offset += length;
    }
}
