//! Tokens for a validated [`Model`].
//!
//! Hygiene rules for everything emitted here (so the generated code means the same in any
//! user module and needs no direct dependency on serde_json or sqlx):
//! - the runtime is named only as `#krate::…` (`::outbox` by default), and std items only
//!   through `#krate::__private`, so a user's shadowed `Result`, `Option`, `Into`, `str` or
//!   `u32` cannot change what the code means;
//! - generated parameters and generics start with `__`, so they cannot collide with the
//!   user's type (a payload struct named `P`) or a constant in scope;
//! - the impl and the bound check sit in `const _: () = { … };`; the free functions cannot
//!   (they must be callable from the module), so they are one-line wrappers over the
//!   runtime's generic `publish_timer` / `extend_timer` / `cancel_timer`.

use heck::ToSnakeCase;
use proc_macro2::{Ident, Literal, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::ext::IdentExt;

use crate::model::{Declared, Model};

/// The names of the generated functions for a payload type.
pub(crate) struct FnNames {
    pub(crate) publish: Ident,
    pub(crate) extend: Ident,
    pub(crate) extend_with_slack: Ident,
    pub(crate) cancel: Ident,
}

/// `PresenceExpiry` → `publish_presence_expiry`, …; spanned at the type's name, so
/// "defined multiple times" and go-to-definition point at the struct.
pub(crate) fn fn_names(ident: &Ident) -> FnNames {
    let snake = ident.unraw().to_string().to_snake_case();
    let span = ident.span();
    FnNames {
        publish: format_ident!("publish_{}", snake, span = span),
        extend: format_ident!("extend_{}", snake, span = span),
        extend_with_slack: format_ident!("extend_{}_with_slack", snake, span = span),
        cancel: format_ident!("cancel_{}", snake, span = span),
    }
}

/// The `Timer` impl, the payload bound check and the four functions.
pub(crate) fn expand(model: &Model) -> TokenStream {
    let Model {
        ident, vis, krate, ..
    } = model;
    let private = quote!(#krate::__private);
    // Fresh literals at the call site, not the user's tokens: lints that read the source
    // (clippy's digit grouping, say) must not fire on an attribute argument.
    let queue = Literal::string(&model.queue);
    let max_deliveries = Literal::u32_unsuffixed(model.max_deliveries);

    // Spanned at the struct's name: rustc reports an impl's unmet supertraits at its
    // header, so a payload that is not `Serialize`/`DeserializeOwned`/`Send`/`Sync` is
    // reported once, at the struct ("the trait bound `PresenceExpiry: Serialize` is not
    // satisfied ... required by a bound in `Timer`"), not inside generated code. The
    // impl still exists for the rest of the program, so its uses add no errors.
    let impl_header = quote_spanned! {ident.span()=>
        impl #krate::Timer for #ident
    };

    let names = fn_names(ident);
    let FnNames {
        publish,
        extend,
        extend_with_slack,
        cancel,
    } = &names;
    let docs = Docs::new(model);
    let (doc_publish, doc_extend, doc_slack, doc_cancel) = (
        &docs.publish,
        &docs.extend,
        &docs.extend_with_slack,
        &docs.cancel,
    );

    let declared_schedule = model.schedule.as_ref().map(|s| declared_schedule(s, krate));

    quote! {
        #[doc(hidden)]
        const _: () = {
            #[automatically_derived]
            #impl_header {
                const QUEUE: &'static #private::str = #queue;
                const MAX_DELIVERIES: #private::u32 = #max_deliveries;
                #declared_schedule
            }
        };

        #[doc = #doc_publish]
        #[allow(dead_code)] // a user may need only some of the four
        #vis async fn #publish(
            __conn: impl #krate::Publisher,
            __timer_id: &#private::str,
            __payload: &#ident,
            __schedule: impl #private::Into<#krate::message::Schedule>,
        ) -> #private::Result<#krate::Published, #krate::Error> {
            #krate::message::publish_timer::<#ident>(__conn, __timer_id, __payload, __schedule).await
        }

        #[doc = #doc_extend]
        #[allow(dead_code)] // a user may need only some of the four
        #vis async fn #extend(
            __conn: impl #krate::Publisher,
            __timer_id: &#private::str,
            __payload: &#ident,
            __schedule: impl #private::Into<#krate::message::Schedule>,
        ) -> #private::Result<#krate::Published, #krate::Error> {
            #krate::message::extend_timer::<#ident>(__conn, __timer_id, __payload, __schedule).await
        }

        #[doc = #doc_slack]
        #[allow(dead_code)] // a user may need only some of the four
        #vis async fn #extend_with_slack(
            __conn: impl #krate::Publisher,
            __timer_id: &#private::str,
            __payload: &#ident,
            __schedule: impl #private::Into<#krate::message::Schedule>,
            __slack: #private::Duration,
        ) -> #private::Result<#krate::Published, #krate::Error> {
            #krate::message::extend_timer_with_slack::<#ident>(
                __conn, __timer_id, __payload, __schedule, __slack,
            )
            .await
        }

        #[doc = #doc_cancel]
        #[allow(dead_code)] // a user may need only some of the four
        #vis async fn #cancel(
            __conn: impl #krate::Publisher,
            __timer_id: &#private::str,
        ) -> #private::Result<#krate::Cancelled, #krate::Error> {
            #krate::message::cancel_timer::<#ident>(__conn, __timer_id).await
        }
    }
}

/// `Timer::declared_schedule` for `every`/`cron`. The call is spanned at the string, so a
/// payload without `Default` is reported there (with the runtime's message saying what to
/// do), not inside generated code.
fn declared_schedule(schedule: &Declared, krate: &syn::Path) -> TokenStream {
    let private = quote!(#krate::__private);
    let call = match schedule {
        Declared::Every { text, span } => {
            let text = Literal::string(text);
            quote_spanned! {*span=> #private::every_schedule::<Self>(#text) }
        }
        Declared::Cron { expr, tz, span } => {
            let (expr, tz) = (Literal::string(expr), Literal::string(tz));
            quote_spanned! {*span=> #private::cron_schedule::<Self>(#expr, #tz) }
        }
    };
    quote! {
        fn declared_schedule() -> #private::Option<(
            #private::Result<#krate::periodic::Recurrence, #krate::Error>,
            Self,
        )> {
            #private::Option::Some(#call)
        }
    }
}

/// Doc comments of the generated functions. They are public API of the user's crate, so
/// they must satisfy `#![deny(missing_docs)]` and clippy's `missing_errors_doc`. They link
/// to nothing: an intra-doc link could break under `crate = "..."` or a private payload.
struct Docs {
    publish: String,
    extend: String,
    extend_with_slack: String,
    cancel: String,
}

impl Docs {
    fn new(model: &Model) -> Docs {
        let ty = model.ident.unraw();
        let queue = &model.queue;
        let common = format!(
            "\n\n`__conn` is where to publish: the caller's transaction (`&mut *tx`; nothing is \
             written unless it commits), a pooled connection (`&mut *conn`), `&pool` \
             (autocommit), `outbox.on(&mut *tx)` for an `Outbox` with its own table names, or \
             `&store`. `__timer_id` is the timer's key (1..=255 \
             bytes, no NUL).\n\n\
             Generated by `#[outbox::timer]` on `{ty}`."
        );
        let errors_publish = "\n\n# Errors\n\n`Error::Encode` when the payload does not \
             serialize; `Error::InvalidArgument` for a bad timer id or schedule, before any \
             SQL runs; `Error::Database`.";
        let publish = format!(
            "Schedules the `{ty}` timer `__timer_id` in queue `{queue}` with `__payload`, \
             due at `__schedule` (a `Duration` from the database's clock, an absolute time, \
             or `Schedule::now()`).\n\n\
             If a live timer already holds the key, nothing changes: `Published::Skipped`. \
             Use the `extend_` function to move an existing timer.\
             {common} Same as `outbox::message::publish_timer::<{ty}, _>`.{errors_publish}"
        );
        let extend = format!(
            "Schedules or extends the `{ty}` timer `__timer_id` in queue `{queue}`, due at \
             `__schedule`.\n\n\
             No live timer: inserts one (`Published::Inserted`). A pending timer with an \
             earlier deadline: moves the deadline and replaces the payload \
             (`Published::Extended`). A timer whose handler is running: queues a rearm, so \
             it fires again at the new deadline with `__payload` once the run ends \
             (`Published::RearmQueued`). A deadline that is not later than the timer's \
             changes nothing (`Published::Unchanged`): a timer never moves earlier.\
             {common} Same as `outbox::message::extend_timer::<{ty}, _>`.{errors_publish}"
        );
        let extend_with_slack = format!(
            "As `extend_{snake}`, but a move of a pending timer's deadline (or of a queued \
             rearm's) by `__slack` or less writes nothing (`Published::Unchanged`), so a \
             timer extended on every request writes its row about once per `__slack` (a \
             `Duration`). A running timer without a queued rearm always gets the rearm.\n\n\
             The timer may then fire up to `__slack` **earlier** than this call asked: the \
             handler must re-check the activity the timer stands for and, when the real \
             deadline has not passed, extend the timer again to it instead of acting. A \
             timer never fires later than asked.\
             {common} Same as `outbox::message::extend_timer_with_slack::<{ty}, _>`.{errors_publish} \
             A `__slack` over `outbox::message::MAX_SLACK` is `Error::InvalidArgument` too.",
            snake = ty.to_string().to_snake_case()
        );
        let cancel = format!(
            "Cancels the `{ty}` timer `__timer_id` in queue `{queue}`.\n\n\
             The row is locked first (`SELECT … FOR UPDATE`), so a run cannot finish and \
             re-arm the timer between the cancel's look and its write. A pending timer is \
             deleted (`Cancelled::Deleted`). A running timer is never deleted by the \
             cancel: it is marked, and however its run ends the row is then deleted (no \
             retry, no rearm, no dead letter); a rearm queued behind it is dropped \
             (`Cancelled::RearmDropped`, else `Cancelled::Running`). An extend after the \
             cancel re-arms the timer. No live timer: `Cancelled::NotFound`.\
             {common} Same as `outbox::message::cancel_timer::<{ty}, _>`.\n\n\
             # Errors\n\n`Error::InvalidArgument` for a bad timer id, before any SQL runs; \
             `Error::Database`."
        );
        Docs {
            publish,
            extend,
            extend_with_slack,
            cancel,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(ty: &str) -> [String; 4] {
        let ident: Ident = syn::parse_str(ty).unwrap();
        let n = fn_names(&ident);
        [
            n.publish.to_string(),
            n.extend.to_string(),
            n.cancel.to_string(),
            n.extend_with_slack.to_string(),
        ]
    }

    #[test]
    fn function_names_are_snake_case() {
        assert_eq!(
            names("PresenceExpiry"),
            [
                "publish_presence_expiry",
                "extend_presence_expiry",
                "cancel_presence_expiry",
                "extend_presence_expiry_with_slack"
            ]
        );
        assert_eq!(names("Tick")[0], "publish_tick");
        assert_eq!(names("HTTPTimeout")[0], "publish_http_timeout");
        assert_eq!(names("r#Match")[1], "extend_match");
        assert_eq!(names("Retry2Later")[2], "cancel_retry2_later");
        assert_eq!(names("r#Match")[3], "extend_match_with_slack");
    }
}
