//! `#[derive(FromRef)]`: one `FromRef<State>` impl per field of a state struct, so a handler
//! can ask its [`Context`] for a field by its type.
//!
//! Attributes: `#[from_ref(skip)]` on a field leaves it out (two fields of one type would
//! otherwise give two conflicting impls); `#[from_ref(crate = "path")]` on the struct names
//! the runtime when `outbox` is re-exported or renamed. Generic state structs are refused:
//! implement `FromRef` by hand for those.

use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Data, DeriveInput, Fields, LitStr};

pub(crate) fn derive(input: TokenStream) -> TokenStream {
    match expand(input) {
        Ok(tokens) => tokens,
        Err(e) => e.to_compile_error(),
    }
}

fn expand(input: TokenStream) -> syn::Result<TokenStream> {
    let input: DeriveInput = syn::parse2(input)?;
    let mut krate: syn::Path = syn::parse_quote!(::outbox);
    for attr in input.attrs.iter().filter(|a| a.path().is_ident("from_ref")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("crate") {
                let path: LitStr = meta.value()?.parse()?;
                krate = path.parse()?;
                Ok(())
            } else {
                Err(meta.error("expected `crate = \"path\"`"))
            }
        })?;
    }
    if !input.generics.params.is_empty() {
        return Err(syn::Error::new(
            input.generics.span(),
            "FromRef cannot be derived for a generic state struct; implement `outbox::FromRef` by hand",
        ));
    }
    let Data::Struct(data) = &input.data else {
        return Err(syn::Error::new(
            input.ident.span(),
            "FromRef is derived for a state struct: each field becomes a piece handlers can ask for",
        ));
    };
    let name = &input.ident;
    let mut impls = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    let fields: Vec<_> = match &data.fields {
        Fields::Named(f) => f.named.iter().collect(),
        Fields::Unnamed(f) => f.unnamed.iter().collect(),
        Fields::Unit => Vec::new(),
    };
    for (i, field) in fields.into_iter().enumerate() {
        let mut skip = false;
        for attr in field.attrs.iter().filter(|a| a.path().is_ident("from_ref")) {
            attr.parse_nested_meta(|meta| {
                if meta.path.is_ident("skip") {
                    skip = true;
                    Ok(())
                } else {
                    Err(meta.error("expected `skip`"))
                }
            })?;
        }
        if skip {
            continue;
        }
        let ty = &field.ty;
        let spelled = quote!(#ty)
            .to_string()
            .replace(" :: ", "::")
            .replace(":: ", "::")
            .replace(" <", "<")
            .replace("< ", "<")
            .replace(" >", ">")
            .replace(" ,", ",");
        if seen.contains(&spelled) {
            return Err(syn::Error::new_spanned(
                ty,
                format!(
                    "a second field of type `{spelled}`: a handler asking for `{spelled}` would be ambiguous; \
                     mark all but one `#[from_ref(skip)]`, or wrap one in a type of its own"
                ),
            ));
        }
        if spelled
            .split(|c: char| !c.is_alphanumeric() && c != '_')
            .any(|w| w == "Self")
        {
            return Err(syn::Error::new_spanned(
                ty,
                format!("name the state type instead of `Self` in this field's type (`{spelled}`), or mark it `#[from_ref(skip)]`"),
            ));
        }
        seen.push(spelled);
        let access = match &field.ident {
            Some(ident) => quote!(#ident),
            None => {
                let index = syn::Index::from(i);
                quote!(#index)
            }
        };
        impls.push(quote_spanned! {ty.span()=>
            impl #krate::FromRef<#name> for #ty {
                fn from_ref(state: &#name) -> Self {
                    ::core::clone::Clone::clone(&state.#access)
                }
            }
        });
    }
    Ok(quote!(#(#impls)*))
}
