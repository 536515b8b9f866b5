//! The rules on `#[timer]`'s input: the queue name, `max_deliveries`, the schedule (in
//! `schedule.rs`), and the shape of the annotated item. Every broken rule is recorded, spanned at its token.

use proc_macro2::Span;
use syn::{Ident, Item, LitStr, Visibility};

use crate::args::{example, Args, IntArg, Slot};
use crate::errors::Errors;
use crate::model::Model;
use crate::schedule;

/// The longest queue name, in bytes: the `queue` column is `varchar(255)`.
pub(crate) const MAX_QUEUE_BYTES: usize = 255;

/// What validation produced.
pub(crate) enum Checked {
    /// Everything is valid: expand this.
    Valid(Model),
    /// Something is wrong (the errors are in [`Errors`]). When the struct itself is fine
    /// and only the arguments are wrong, `Some` holds a stand-in model with placeholder
    /// values, expanded next to the errors so code using the type and its functions does
    /// not fail a second time.
    Invalid(Option<Model>),
}

/// Checks the arguments against the item and builds the model.
pub(crate) fn check(args: Args, item: &Item, errors: &mut Errors) -> Checked {
    let queue = match args.queue {
        Slot::Given(lit) => check_queue(&lit, errors),
        Slot::Absent => {
            errors.error_at(
                Span::call_site(),
                format!("missing `queue` argument, like {}", example("queue")),
            );
            None
        }
        Slot::Invalid => None,
    };
    let max_deliveries = match args.max_deliveries {
        Slot::Given(int) => check_max_deliveries(&int, errors),
        Slot::Absent => {
            errors.error_at(
                Span::call_site(),
                format!(
                    "missing `max_deliveries` argument, like {}: how many times a row may \
                     be claimed before it is a terminal failure",
                    example("max_deliveries")
                ),
            );
            None
        }
        Slot::Invalid => None,
    };
    let schedule = schedule::check(args.every, args.cron, args.tz, errors);
    let krate = match args.krate {
        Slot::Given(path) => path,
        Slot::Absent | Slot::Invalid => syn::parse_quote!(::outbox),
    };
    let target = check_item(item, errors);

    let Some((ident, vis)) = target else {
        return Checked::Invalid(None);
    };
    let model = Model {
        ident,
        vis,
        // Placeholders for the stand-in expansion; never compiled into a working program.
        queue: queue.unwrap_or_default(),
        max_deliveries: max_deliveries.unwrap_or(1),
        krate,
        schedule,
    };
    if errors.is_empty() {
        Checked::Valid(model)
    } else {
        Checked::Invalid(Some(model))
    }
}

/// 1..=255 bytes of `[A-Za-z0-9._:-]`: safe in metric labels, log lines, URLs and shell
/// commands, and visibly the same name everywhere (no look-alike Unicode, no spaces).
fn check_queue(lit: &LitStr, errors: &mut Errors) -> Option<String> {
    let queue = lit.value();
    let mut ok = true;
    if queue.is_empty() {
        errors.error(lit, "`queue` must not be empty");
        return None;
    }
    if queue.len() > MAX_QUEUE_BYTES {
        errors.error(
            lit,
            format!(
                "`queue` is {} bytes long; the limit is {MAX_QUEUE_BYTES} (the column is varchar(255))",
                queue.len()
            ),
        );
        ok = false;
    }
    let mut bad: Vec<char> = Vec::new();
    for c in queue.chars() {
        if !allowed_in_queue(c) && !bad.contains(&c) {
            bad.push(c);
        }
    }
    if !bad.is_empty() {
        let list: Vec<String> = bad.iter().map(|c| format!("{c:?}")).collect();
        errors.error(
            lit,
            format!(
                "`queue` contains {}; only ASCII letters, digits, `.`, `_`, `:` and `-` are allowed",
                list.join(", ")
            ),
        );
        ok = false;
    }
    ok.then_some(queue)
}

pub(crate) fn allowed_in_queue(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | ':' | '-')
}

fn check_max_deliveries(int: &IntArg, errors: &mut Errors) -> Option<u32> {
    let suffix = int.lit.suffix();
    if !suffix.is_empty() && suffix != "u32" {
        errors.error(
            &int.lit,
            format!("`max_deliveries` is a u32; remove the `{suffix}` suffix"),
        );
        return None;
    }
    // syn folds `-1` into one negative literal inside attributes; `- 1` arrives as a unary
    // minus. Both are negative.
    if int.negative || int.lit.base10_digits().starts_with('-') {
        errors.error(
            &int.expr,
            "`max_deliveries` must be at least 1, not negative: a row needs one delivery to run at all",
        );
        return None;
    }
    // Parsed as u128 first, so an over-large value says "too large", not "invalid digit".
    match int.lit.base10_parse::<u128>() {
        Ok(0) => {
            errors.error(
                &int.lit,
                "`max_deliveries` must be at least 1: a row needs one delivery to run at all",
            );
            None
        }
        Ok(n) => match u32::try_from(n) {
            Ok(n) => Some(n),
            Err(_) => {
                errors.error(
                    &int.lit,
                    format!("`max_deliveries` must fit in a u32 (at most {})", u32::MAX),
                );
                None
            }
        },
        Err(_) => {
            errors.error(
                &int.lit,
                format!("`max_deliveries` must fit in a u32 (at most {})", u32::MAX),
            );
            None
        }
    }
}

/// The item must be a struct without generics: a queue holds one concrete payload type,
/// and `Timer` needs `DeserializeOwned + 'static`, which rules out borrowed fields anyway.
///
/// Returns the struct's name and visibility when it is acceptable. Anything else gets no
/// stand-in expansion: a stand-in `impl Timer` for an enum would pretend it is a timer and
/// add serde errors on top of the one that matters.
fn check_item(item: &Item, errors: &mut Errors) -> Option<(Ident, Visibility)> {
    match item {
        Item::Struct(s) => {
            if !s.generics.params.is_empty() {
                errors.error(
                    &s.generics,
                    "`#[timer]` does not support generic structs: a queue holds one concrete \
                     payload type; wrap each instantiation in its own struct",
                );
                return None;
            }
            if let Some(where_clause) = &s.generics.where_clause {
                errors.error(where_clause, "`#[timer]` does not support `where` clauses");
                return None;
            }
            Some((s.ident.clone(), s.vis.clone()))
        }
        Item::Enum(e) => {
            errors.error(
                e.enum_token,
                "`#[timer]` can only be applied to a struct, not an enum; put the enum in a \
                 field of a struct",
            );
            None
        }
        Item::Union(u) => {
            errors.error(
                u.union_token,
                "`#[timer]` can only be applied to a struct, not a union",
            );
            None
        }
        other => {
            let span = match other {
                Item::Fn(f) => f.sig.ident.span(),
                Item::Trait(t) => t.ident.span(),
                Item::Type(t) => t.ident.span(),
                Item::Mod(m) => m.ident.span(),
                Item::Const(c) => c.ident.span(),
                Item::Static(s) => s.ident.span(),
                _ => Span::call_site(),
            };
            errors.error_at(span, "`#[timer]` can only be applied to a struct");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_alphabet() {
        for c in "azAZ09._:-".chars() {
            assert!(allowed_in_queue(c), "{c:?}");
        }
        for c in " /\\\0é*#\n".chars() {
            assert!(!allowed_in_queue(c), "{c:?}");
        }
    }
}
