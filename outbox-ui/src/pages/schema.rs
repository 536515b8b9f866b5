//! `/schema`: `validate_schema` and the migration steps not applied yet.

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use maud::html;

use crate::layout::{self, Base, Notice};
use crate::state::State as Shared;

pub(crate) async fn page(
    State(s): State<Shared>,
    base: Base,
    Query(notice): Query<Notice>,
) -> Response {
    let check = s.outbox.validate_schema(&s.pool).await;
    let applied = s.outbox.applied_migrations(&s.pool).await;
    let steps = s.outbox.migration_steps();
    let body = html! {
        h2 { "Check" }
        @match &check {
            Ok(()) => p.notice.ok { "The schema matches this version." },
            Err(outbox::Error::SchemaMismatch { problems }) => {
                p.notice.error { (problems.len()) " problem(s): the schema does not match this version." }
                ul { @for p in problems { li { (p) } } }
            }
            Err(e) => p.notice.error { (e) },
        }
        h2 { "Migration steps" }
        @match &applied {
            Ok(applied) => {
                @let pending: Vec<_> = steps.iter().filter(|st| !applied.iter().any(|a| a.version == st.version)).collect();
                p { (applied.len()) " applied, " (pending.len()) " pending"
                    @if !pending.is_empty() { " (run " code { "outbox migrate" } " or " code { "Outbox::migrate" } ")" } "." }
                table {
                    thead { tr { th scope="col" { "Version" } th scope="col" { "Step" } th scope="col" { "State" } } }
                    tbody {
                        @for st in &steps {
                            @let a = applied.iter().find(|a| a.version == st.version);
                            tr {
                                td { (st.version) }
                                td { (st.description) }
                                td { @match a {
                                    Some(a) => { "applied " (crate::format::utc(a.applied_at)) @if a.found { " (found in place)" } }
                                    None => strong { "pending" },
                                } }
                            }
                        }
                    }
                }
            }
            Err(e) => p.notice.error { (e) },
        }
    };
    layout::page(&base, &s, "Schema", "schema", &notice, false, body).into_response()
}
