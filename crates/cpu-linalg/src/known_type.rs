//! A value of a generic type handed over as the one type it was found to be: how code generic
//! over Burn's backends, having compared a backend's `TypeId` with those of its list, calls the
//! code written for that backend.

use std::any::Any;

/// `value` as `U`, the type its `TypeId` was checked to be.
///
/// # Panics
/// Where `T` is not `U`: the caller compares their `TypeId`s first.
pub(crate) fn into_known_type<T: 'static, U: 'static>(value: T) -> U {
    *(Box::new(value) as Box<dyn Any>)
        .downcast::<U>()
        .expect("the caller checked the type")
}
