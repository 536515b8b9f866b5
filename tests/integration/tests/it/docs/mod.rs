//! What the docs promise, checked: the README's quick start and links, its examples run as
//! tests, the public surface of the runtime crate.

mod periodic_example;
mod readme;
mod surface;
mod testing_example;
