//! Parsing `#[timer(...)]`'s arguments into typed values.
//!
//! This module only reads the *shape* of each argument (a string literal, an integer
//! literal, a path in a string); the rules on the values (queue characters, `max_deliveries`
//! at least 1, ...) are `validate.rs`'s. Every problem is recorded in the shared
//! [`Errors`], spanned at its own token, so one compile shows them all.

use darling::ast::NestedMeta;
use proc_macro2::TokenStream;
use syn::{Expr, Lit, LitInt, LitStr, Meta, Path, UnOp};

use crate::errors::Errors;

/// The argument names, in the order the error messages list them.
pub(crate) const ARGUMENTS: &[&str] = &["queue", "max_deliveries", "every", "cron", "tz", "crate"];

/// One argument's state after parsing.
pub(crate) enum Slot<T> {
    /// Not written.
    Absent,
    /// Written, but malformed; the error is already recorded, so validation must not add
    /// a second one (for example "missing `queue`" after "`queue` must be a string").
    Invalid,
    /// Written and well-formed.
    Given(T),
}

impl<T> Slot<T> {
    fn is_absent(&self) -> bool {
        matches!(self, Slot::Absent)
    }
}

/// An integer literal as written, with its sign kept so validation can say "negative"
/// instead of "not an integer".
pub(crate) struct IntArg {
    /// The whole value expression (`5`, `-1`), for spans covering the sign too.
    pub(crate) expr: Expr,
    pub(crate) negative: bool,
    pub(crate) lit: LitInt,
}

/// The arguments of one `#[timer(...)]`.
pub(crate) struct Args {
    pub(crate) queue: Slot<LitStr>,
    pub(crate) max_deliveries: Slot<IntArg>,
    /// `every = "5m"`: a fixed-interval schedule.
    pub(crate) every: Slot<LitStr>,
    /// `cron = "0 0 6 * * *"`: a cron schedule (feature `cron`).
    pub(crate) cron: Slot<LitStr>,
    /// `tz = "Europe/Berlin"`: the zone of `cron`.
    pub(crate) tz: Slot<LitStr>,
    pub(crate) krate: Slot<Path>,
}

impl Args {
    /// Parses the attribute's arguments, recording every problem in `errors`.
    pub(crate) fn parse(tokens: TokenStream, errors: &mut Errors) -> Args {
        let mut args = Args {
            queue: Slot::Absent,
            max_deliveries: Slot::Absent,
            every: Slot::Absent,
            cron: Slot::Absent,
            tz: Slot::Absent,
            krate: Slot::Absent,
        };
        let metas = match NestedMeta::parse_meta_list(tokens) {
            Ok(metas) => metas,
            Err(err) => {
                // The token stream is not a comma-separated list at all; nothing after the
                // syntax error can be trusted, and "missing `queue`" on top would be noise.
                errors.push(err);
                args.queue = Slot::Invalid;
                args.max_deliveries = Slot::Invalid;
                args.every = Slot::Invalid;
                args.cron = Slot::Invalid;
                args.tz = Slot::Invalid;
                args.krate = Slot::Invalid;
                return args;
            }
        };
        for meta in metas {
            match meta {
                NestedMeta::Lit(lit) => errors.error(
                    &lit,
                    format!(
                        "expected `name = value` arguments, found a literal; {}",
                        usage()
                    ),
                ),
                NestedMeta::Meta(meta) => args.parse_one(meta, errors),
            }
        }
        args
    }

    fn parse_one(&mut self, meta: Meta, errors: &mut Errors) {
        let path = meta.path();
        let name = match path.get_ident() {
            Some(ident) => ident.to_string(),
            None => {
                errors.error(
                    path,
                    format!("unknown argument `{}`; {}", path_string(path), expected()),
                );
                return;
            }
        };
        let already = match name.as_str() {
            "queue" => !self.queue.is_absent(),
            "max_deliveries" => !self.max_deliveries.is_absent(),
            "every" => !self.every.is_absent(),
            "cron" => !self.cron.is_absent(),
            "tz" => !self.tz.is_absent(),
            "crate" => !self.krate.is_absent(),
            _ => {
                errors.error(path, format!("unknown argument `{name}`; {}", expected()));
                return;
            }
        };
        if already {
            errors.error(path, format!("duplicate argument `{name}`"));
            return;
        }
        let value = match meta {
            Meta::NameValue(nv) => Some(nv.value),
            Meta::Path(ref path) => {
                errors.error(path, format!("`{name}` needs a value: {}", example(&name)));
                None
            }
            Meta::List(ref list) => {
                errors.error(
                    list,
                    format!("`{name}` takes a value after `=`: {}", example(&name)),
                );
                None
            }
        };
        match name.as_str() {
            "queue" => self.queue = value.map_or(Slot::Invalid, |v| parse_str("queue", v, errors)),
            "every" => self.every = value.map_or(Slot::Invalid, |v| parse_str("every", v, errors)),
            "cron" => self.cron = value.map_or(Slot::Invalid, |v| parse_str("cron", v, errors)),
            "tz" => self.tz = value.map_or(Slot::Invalid, |v| parse_str("tz", v, errors)),
            "max_deliveries" => {
                self.max_deliveries =
                    value.map_or(Slot::Invalid, |v| parse_max_deliveries(v, errors));
            }
            _ => self.krate = value.map_or(Slot::Invalid, |v| parse_crate(v, errors)),
        }
    }
}

/// A string-literal argument (`queue`, `every`, `cron`, `tz`).
fn parse_str(name: &str, value: Expr, errors: &mut Errors) -> Slot<LitStr> {
    match strip_groups(value) {
        Expr::Lit(syn::ExprLit {
            lit: Lit::Str(s), ..
        }) => Slot::Given(s),
        other => {
            errors.error(
                &other,
                format!("`{name}` must be a string literal, like {}", example(name)),
            );
            Slot::Invalid
        }
    }
}

fn parse_max_deliveries(value: Expr, errors: &mut Errors) -> Slot<IntArg> {
    let value = strip_groups(value);
    let int = match &value {
        Expr::Lit(syn::ExprLit {
            lit: Lit::Int(lit), ..
        }) => Some((false, lit.clone())),
        Expr::Unary(syn::ExprUnary {
            op: UnOp::Neg(_),
            expr,
            ..
        }) => match strip_groups((**expr).clone()) {
            Expr::Lit(syn::ExprLit {
                lit: Lit::Int(lit), ..
            }) => Some((true, lit)),
            _ => None,
        },
        _ => None,
    };
    match int {
        Some((negative, lit)) => Slot::Given(IntArg {
            expr: value,
            negative,
            lit,
        }),
        None => {
            errors.error(
                &value,
                format!(
                    "`max_deliveries` must be an integer literal, like {}",
                    example("max_deliveries")
                ),
            );
            Slot::Invalid
        }
    }
}

fn parse_crate(value: Expr, errors: &mut Errors) -> Slot<Path> {
    match strip_groups(value) {
        Expr::Lit(syn::ExprLit {
            lit: Lit::Str(s), ..
        }) => match s.parse::<Path>() {
            Ok(path) => Slot::Given(path),
            Err(_) => {
                errors.error(
                    &s,
                    format!("`crate` must name a path, like {}", example("crate")),
                );
                Slot::Invalid
            }
        },
        other => {
            errors.error(
                &other,
                format!(
                    "`crate` must be a path in a string literal, like {}",
                    example("crate")
                ),
            );
            Slot::Invalid
        }
    }
}

/// `macro_rules!` wraps an interpolated `$e:expr` in an invisible group; look through it
/// (and through parentheses) so `queue = $q` works from a user's declarative macro.
fn strip_groups(mut expr: Expr) -> Expr {
    loop {
        expr = match expr {
            Expr::Group(g) => *g.expr,
            Expr::Paren(p) => *p.expr,
            other => return other,
        }
    }
}

fn path_string(path: &Path) -> String {
    let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
    let lead = if path.leading_colon.is_some() {
        "::"
    } else {
        ""
    };
    format!("{lead}{}", segments.join("::"))
}

/// "expected one of `queue`, `max_deliveries` or `crate`"
pub(crate) fn expected() -> String {
    let names: Vec<String> = ARGUMENTS.iter().map(|n| format!("`{n}`")).collect();
    let (last, rest) = names.split_last().expect("ARGUMENTS is not empty");
    format!("expected one of {} or {last}", rest.join(", "))
}

fn usage() -> String {
    format!(
        "write {}, {} and optionally {}, {} (with {}) or {}",
        example("queue"),
        example("max_deliveries"),
        example("every"),
        example("cron"),
        example("tz"),
        example("crate")
    )
}

/// How an argument is written, for error messages.
pub(crate) fn example(name: &str) -> &'static str {
    match name {
        "queue" => "`queue = \"presence.expiry\"`",
        "max_deliveries" => "`max_deliveries = 5`",
        "every" => "`every = \"5m\"`",
        "cron" => "`cron = \"0 0 6 * * *\"`",
        "tz" => "`tz = \"Europe/Berlin\"`",
        _ => "`crate = \"my_crate::outbox\"`",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(tokens: TokenStream) -> (Args, usize) {
        let mut errors = Errors::default();
        let args = Args::parse(tokens, &mut errors);
        let n = errors
            .into_compile_errors()
            .to_string()
            .matches("compile_error")
            .count();
        (args, n)
    }

    #[test]
    fn error_message_lists_every_argument() {
        assert_eq!(
            expected(),
            "expected one of `queue`, `max_deliveries`, `every`, `cron`, `tz` or `crate`"
        );
    }

    #[test]
    fn well_formed_arguments() {
        let (args, errors) = parse(quote::quote!(
            queue = "a",
            max_deliveries = 3,
            every = "5m",
            cron = "0 * * * *",
            tz = "UTC",
            crate = "x::y"
        ));
        assert_eq!(errors, 0);
        assert!(matches!(args.every, Slot::Given(ref e) if e.value() == "5m"));
        assert!(matches!(args.cron, Slot::Given(ref c) if c.value() == "0 * * * *"));
        assert!(matches!(args.tz, Slot::Given(ref t) if t.value() == "UTC"));
        assert!(matches!(args.queue, Slot::Given(ref q) if q.value() == "a"));
        assert!(matches!(args.max_deliveries, Slot::Given(ref n) if !n.negative));
        assert!(matches!(args.krate, Slot::Given(ref p) if p.segments.len() == 2));
    }

    #[test]
    fn every_problem_is_recorded() {
        let (args, errors) = parse(quote::quote!(
            queue = 1,
            max_deliveries = "2",
            crate = "not a path",
            retries = 3,
            queue = "b",
            every = 5,
            tz,
            "lit"
        ));
        assert_eq!(errors, 8);
        assert!(matches!(args.queue, Slot::Invalid));
        assert!(matches!(args.max_deliveries, Slot::Invalid));
        assert!(matches!(args.krate, Slot::Invalid));
    }

    #[test]
    fn a_syntax_error_suppresses_missing_argument_errors() {
        let (args, errors) = parse(quote::quote!(queue = = "a"));
        assert_eq!(errors, 1);
        assert!(matches!(args.queue, Slot::Invalid));
        assert!(matches!(args.max_deliveries, Slot::Invalid));
    }
}
