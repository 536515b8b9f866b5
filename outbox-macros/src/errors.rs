//! The problems found while reading and checking one attribute, collected rather than
//! returned on the first, so one compile shows them all. A leaf: parsing (`args.rs`) and
//! the checks (`validate.rs`, `schedule.rs`) push into it; `lib.rs` turns it into tokens.

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;

/// The problems found so far, each spanned at its token. serde_derive's `Ctxt` in small:
/// parsing and validation push into it and go on, and the caller turns the lot into
/// `compile_error!`s at the end.
#[derive(Default)]
pub(crate) struct Errors {
    errors: Option<syn::Error>,
}

impl Errors {
    /// Records `message` spanned over `tokens` (first to last token, as rustc underlines).
    pub(crate) fn error<T: ToTokens, M: std::fmt::Display>(&mut self, tokens: T, message: M) {
        self.push(syn::Error::new_spanned(tokens, message));
    }

    /// Records `message` at `span`.
    pub(crate) fn error_at<M: std::fmt::Display>(&mut self, span: Span, message: M) {
        self.push(syn::Error::new(span, message));
    }

    pub(crate) fn push(&mut self, error: syn::Error) {
        match &mut self.errors {
            Some(all) => all.combine(error),
            None => self.errors = Some(error),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.errors.is_none()
    }

    /// The `compile_error!` invocations, one per problem.
    pub(crate) fn into_compile_errors(self) -> TokenStream {
        self.errors
            .map(syn::Error::into_compile_error)
            .unwrap_or_default()
    }
}
