//! A matrix in a bare CPU backend's buffer, read in place by the products (`products.rs`,
//! `matvec.rs`, `packed.rs`): [`HostMatrix`], which lends the buffer's floats and holds the tensor
//! that owns them, [`Layout`], how its elements lie, and [`HostBackend`], the backends whose
//! buffers it reads, each telling how. Every module of the products imports them from here, and
//! this module imports none of those.

use burn::prelude::*;
use burn::tensor::TensorPrimitive;
use ndarray::{ArrayView2, ShapeBuilder};

/// A bare CPU backend of `backends.rs`'s list, whose float tensors' buffers [`HostMatrix`] reads:
/// code given one of these backends' tensors reads them as its own, without asking their type
/// again.
pub(crate) trait HostBackend: Backend {
    /// `tensor`'s buffer as a matrix of `columns` columns, or `None` where its elements are not
    /// `f32` or lie neither row- nor column-major.
    fn host_matrix(tensor: Self::FloatTensorPrimitive, columns: usize) -> Option<HostMatrix>;
}

/// `$backend`'s [`HostBackend`] impl: its tensors read by `HostMatrix::$read`.
macro_rules! host_backend {
    ($backend:ty, $read:ident) => {
        impl HostBackend for $backend {
            fn host_matrix(
                tensor: Self::FloatTensorPrimitive,
                columns: usize,
            ) -> Option<HostMatrix> {
                HostMatrix::$read(tensor, columns)
            }
        }
    };
}

#[cfg(feature = "flex")]
host_backend!(burn::backend::Flex, of_flex);
#[cfg(feature = "ndarray")]
host_backend!(burn::backend::NdArray<f32>, of_ndarray);
#[cfg(feature = "ndarray")]
host_backend!(burn::backend::NdArray<f64>, of_ndarray);

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

/// A 2-D `f32` tensor's buffer on a bare CPU backend, borrowed (the tensor it holds keeps the
/// buffer alive).
#[derive(Clone)]
pub(crate) struct HostMatrix {
    tensor: HostTensor,
    pub(crate) layout: Layout,
    pub(crate) columns: usize,
}

/// The bare backend's tensor that owns a [`HostMatrix`]'s buffer, one variant per backend whose
/// float buffers this module reads in place.
#[derive(Clone)]
enum HostTensor {
    #[cfg(feature = "flex")]
    Flex(burn::backend::flex::FlexTensor),
    #[cfg(feature = "ndarray")]
    NdArray(burn::backend::ndarray::NdArrayTensor),
}

impl HostMatrix {
    /// `matrix`'s `f32` buffer, row- or column-major, or `None` for another dtype or layout.
    /// Under `Autodiff`, `products_op.rs` hands over the inner backend's tensors.
    pub(crate) fn of<B: HostBackend>(matrix: &Tensor<B, 2>) -> Option<Self> {
        let columns = matrix.dims()[1];
        let TensorPrimitive::Float(tensor) = matrix.clone().into_primitive() else {
            return None;
        };
        B::host_matrix(tensor, columns)
    }

    /// A burn-flex tensor's buffer: row-major where it is one contiguous piece, else read as the
    /// transpose of its transpose.
    #[cfg(feature = "flex")]
    fn of_flex(tensor: burn::backend::flex::FlexTensor, columns: usize) -> Option<Self> {
        let (tensor, layout) = if tensor.as_slice::<f32>().is_some() {
            (tensor, Layout::RowMajor)
        } else {
            (tensor.transpose(0, 1), Layout::ColumnMajor)
        };
        let matrix = Self {
            tensor: HostTensor::Flex(tensor),
            layout,
            columns,
        };
        matrix.readable().then_some(matrix)
    }

    /// A burn-ndarray tensor's `f32` buffer, in whichever layout its view lies.
    #[cfg(feature = "ndarray")]
    fn of_ndarray(tensor: burn::backend::ndarray::NdArrayTensor, columns: usize) -> Option<Self> {
        let burn::backend::ndarray::NdArrayTensor::F32(storage) = &tensor else {
            return None;
        };
        let layout = match storage.view().to_slice() {
            Some(_) => Layout::RowMajor,
            None => Layout::ColumnMajor,
        };
        let matrix = Self {
            tensor: HostTensor::NdArray(tensor),
            layout,
            columns,
        };
        matrix.readable().then_some(matrix)
    }

    /// The number of rows (`k` of a weight).
    pub(crate) fn rows(&self) -> usize {
        self.floats().len() / self.columns
    }

    /// Whether this matrix is the only holder of its buffer (every other tensor sharing it
    /// dropped), or `None` where that cannot be told: burn-ndarray's buffers borrowed from
    /// outside (a zero-copy load), which are never written but whose lifetime is not counted.
    pub(crate) fn sole_holder(&self) -> Option<bool> {
        match &self.tensor {
            #[cfg(feature = "flex")]
            HostTensor::Flex(tensor) => Some(tensor.is_unique()),
            #[cfg(feature = "ndarray")]
            HostTensor::NdArray(tensor) => match tensor {
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
        match &self.tensor {
            #[cfg(feature = "flex")]
            HostTensor::Flex(tensor) => tensor.as_slice::<f32>(),
            #[cfg(feature = "ndarray")]
            HostTensor::NdArray(tensor) => match tensor {
                burn::backend::ndarray::NdArrayTensor::F32(storage) => match self.layout {
                    Layout::RowMajor => storage.view().to_slice(),
                    Layout::ColumnMajor => storage.view().reversed_axes().to_slice(),
                },
                _ => None,
            },
        }
    }
}
