//! What the expansion needs, after parsing and validation: no tokens to re-check, no
//! `Option`s to unwrap.

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use syn::{Ident, Path, Visibility};

use crate::schedule::Declared;

/// A timer to expand: a non-generic struct with a validated queue and delivery limit.
pub(crate) struct Model {
    /// The payload type, as written.
    pub(crate) ident: Ident,
    /// The type's visibility, given to the generated functions too.
    pub(crate) vis: Visibility,
    /// `QUEUE`, checked.
    pub(crate) queue: String,
    /// `MAX_DELIVERIES`, checked.
    pub(crate) max_deliveries: u32,
    /// The runtime crate's path: `::outbox` unless `crate = "..."` says otherwise.
    pub(crate) krate: Path,
    /// The schedule declared with `every` or `cron`, checked; `None` without one.
    pub(crate) schedule: Option<Declared>,
}

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
