//! The `#[timer]` attribute for the `outbox` crate (placeholder until the macro lands).
use proc_macro::TokenStream;

/// Turns a payload struct into a typed timer.
#[proc_macro_attribute]
pub fn timer(_args: TokenStream, item: TokenStream) -> TokenStream {
    item
}
