//! The seal on [`Store`](super::Store) for 0.x (the `store` module docs say why).

/// A supertrait of [`Store`](super::Store) that only this crate can name, so only its
/// stores implement `Store`; the `testing` feature re-exports it as `testing::Unsealed`
/// for a test's own wrapper of a store.
pub trait Sealed {}
