//! A matrix in a bare CPU backend's buffer, read in place by the products (`products.rs`,
//! `matvec.rs`, `packed.rs`): [`HostMatrix`], which lends the buffer's floats and holds the tensor
//! that owns them, and [`Layout`], how its elements lie. Every module of the products imports
//! them from here, and this module imports none of those.

use std::any::Any;

use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use ndarray::{ArrayView2, ShapeBuilder};

/// How a matrix's elements lie in its buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Layout {
    /// `[rows, columns]` row-major: a `Linear`'s weight, a layer's input.
    RowMajor,
    /// `[columns, rows]` row-major, viewed transposed: an embedding table as a tied LM head.
    ColumnMajor,
}

impl Layout {
    /// `elements` as a `[rows, columns]` matrix laid out this way.
    pub(crate) fn view(
        self,
        rows: usize,
        columns: usize,
        elements: &[f32],
    ) -> Option<ArrayView2<'_, f32>> {
        match self {
            Self::RowMajor => ArrayView2::from_shape((rows, columns), elements),
            Self::ColumnMajor => ArrayView2::from_shape((rows, columns).f(), elements),
        }
        .ok()
    }
}

/// A 2-D `f32` tensor's buffer on a bare CPU backend, borrowed (the tensor's primitive keeps it
/// alive).
#[derive(Clone)]
pub(crate) struct HostMatrix {
    primitive: Primitive,
    pub(crate) layout: Layout,
    pub(crate) columns: usize,
}

/// The backends whose float buffers this module reads in place.
#[derive(Clone)]
enum Primitive {
    #[cfg(feature = "flex")]
    Flex(burn::backend::flex::FlexTensor),
    #[cfg(feature = "ndarray")]
    NdArray(burn::backend::ndarray::NdArrayTensor),
}

impl HostMatrix {
    /// `matrix`'s `f32` buffer, row- or column-major, or `None` for any other backend (under
    /// `Autodiff` too: `products_op.rs` hands over the inner backend's tensors), dtype or layout.
    pub(crate) fn of<B: Backend>(matrix: &Tensor<B, 2>) -> Option<Self> {
        let columns = matrix.dims()[1];
        let TensorPrimitive::Float(primitive) = matrix.clone().into_primitive() else {
            return None;
        };
        let primitive: Box<dyn Any> = Box::new(primitive);
        #[cfg(feature = "flex")]
        let primitive = match primitive.downcast::<burn::backend::flex::FlexTensor>() {
            Ok(tensor) => {
                let (tensor, layout) = match tensor.as_slice::<f32>() {
                    Some(_) => (*tensor, Layout::RowMajor),
                    None => (tensor.transpose(0, 1), Layout::ColumnMajor),
                };
                let matrix = Self {
                    primitive: Primitive::Flex(tensor),
                    layout,
                    columns,
                };
                return matrix.readable().then_some(matrix);
            }
            Err(other) => other,
        };
        #[cfg(feature = "ndarray")]
        if let Ok(tensor) = primitive.downcast::<burn::backend::ndarray::NdArrayTensor>() {
            use burn::backend::ndarray::NdArrayTensor;
            let NdArrayTensor::F32(storage) = &*tensor else {
                return None;
            };
            let layout = match storage.view().to_slice() {
                Some(_) => Layout::RowMajor,
                None => Layout::ColumnMajor,
            };
            let matrix = Self {
                primitive: Primitive::NdArray(*tensor),
                layout,
                columns,
            };
            return matrix.readable().then_some(matrix);
        }
        #[cfg(not(feature = "ndarray"))]
        let _ = primitive;
        None
    }

    /// The number of rows (`k` of a weight).
    pub(crate) fn rows(&self) -> usize {
        self.floats().len() / self.columns
    }

    /// Whether this matrix is the only holder of its buffer (every other tensor sharing it
    /// dropped), or `None` where that cannot be told: burn-ndarray's buffers borrowed from
    /// outside (a zero-copy load), which are never written but whose lifetime is not counted.
    pub(crate) fn sole_holder(&self) -> Option<bool> {
        match &self.primitive {
            #[cfg(feature = "flex")]
            Primitive::Flex(tensor) => Some(tensor.is_unique()),
            #[cfg(feature = "ndarray")]
            Primitive::NdArray(tensor) => match tensor {
                burn::backend::ndarray::NdArrayTensor::F32(storage) if storage.is_owned() => {
                    Some(storage.is_unique())
                }
                _ => None,
            },
        }
    }

    /// The buffer's identity while this matrix holds it: the address and length of its elements,
    /// their layout and the number of columns.
    pub(crate) fn key(&self) -> (usize, usize, Layout, usize) {
        let floats = self.floats();
        (
            floats.as_ptr() as usize,
            floats.len(),
            self.layout,
            self.columns,
        )
    }

    /// Whether [`Self::floats`] can lend the buffer in `layout`.
    fn readable(&self) -> bool {
        self.slice().is_some()
    }

    /// The elements in `layout`'s order.
    pub(crate) fn floats(&self) -> &[f32] {
        self.slice().expect("checked when made")
    }

    fn slice(&self) -> Option<&[f32]> {
        match &self.primitive {
            #[cfg(feature = "flex")]
            Primitive::Flex(tensor) => tensor.as_slice::<f32>(),
            #[cfg(feature = "ndarray")]
            Primitive::NdArray(tensor) => match tensor {
                burn::backend::ndarray::NdArrayTensor::F32(storage) => match self.layout {
                    Layout::RowMajor => storage.view().to_slice(),
                    Layout::ColumnMajor => storage.view().reversed_axes().to_slice(),
                },
                _ => None,
            },
        }
    }
}
