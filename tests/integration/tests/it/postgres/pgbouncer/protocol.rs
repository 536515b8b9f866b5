//! What PgBouncer 1.18 in transaction mode does to sqlx's extended-query protocol: the facts
//! `OutboxBuilder::transaction_pooler` rests on (SPEC §13). Each test shows one with plain
//! sqlx, no outbox code, so a change of PgBouncer's or sqlx's behaviour shows here first.

use futures::future::join_all;
use sqlx::{Connection, Row};

use super::{pooled, Bouncer};

/// sqlx names and caches each prepared statement per client connection; PgBouncer hands the
/// next transaction of that client to whichever server connection is free, where the name
/// was never prepared (or another client's statement of the same name was). Several clients
/// over the small server pool: some statement fails.
#[tokio::test]
async fn named_statements_fail_across_transactions() {
    let b = Bouncer::start();
    let pool = pooled(&b, 6).await;
    let errors = race(&pool, true, true).await;
    assert!(
        errors.iter().any(|e| e.contains("prepared statement")),
        "named statements through PgBouncer 1.18 in transaction mode: {errors:?}"
    );
}

/// An unnamed statement outside a transaction is parsed in one round trip (Parse, Describe,
/// Sync) and bound in the next (Bind, Execute, Sync). PgBouncer releases the server
/// connection at the first ReadyForQuery, so the Bind can reach another server connection,
/// whose unnamed statement is another client's (or none): some statement fails.
#[tokio::test]
async fn unnamed_statements_outside_a_transaction_can_reach_another_server_connection() {
    let b = Bouncer::start();
    let pool = pooled(&b, 6).await;
    let errors = race(&pool, false, false).await;
    assert!(
        !errors.is_empty(),
        "unnamed statements outside a transaction through PgBouncer 1.18: no error"
    );
}

/// Inside a transaction PgBouncer keeps the client on one server connection until the
/// transaction ends, so unnamed statements work: no statement fails.
#[tokio::test]
async fn unnamed_statements_inside_a_transaction_work() {
    let b = Bouncer::start();
    let pool = pooled(&b, 6).await;
    let errors = race(&pool, false, true).await;
    assert_eq!(errors, Vec::<String>::new());
}

/// Six clients, each running 100 rounds of two different statements (different parameter
/// types, so a Bind that reaches the other one fails), named or unnamed, each round in a
/// transaction or not. Returns every error's text.
async fn race(pool: &sqlx::PgPool, named: bool, in_transaction: bool) -> Vec<String> {
    let clients = (0..6i64).map(|c| async move {
        let mut errors = Vec::new();
        let mut conn = pool.acquire().await.expect("a pooled connection");
        for round in 0..100i64 {
            let result = if in_transaction {
                async {
                    let mut tx = conn.begin().await?;
                    let got = round_trip(&mut tx, named, c, round).await?;
                    tx.commit().await?;
                    Ok(got)
                }
                .await
            } else {
                round_trip(&mut conn, named, c, round).await
            };
            match result {
                Ok((text, n)) if text == format!("c{c}") && n == round => {}
                Ok(other) => errors.push(format!(
                    "wrong result {other:?} for client {c} round {round}"
                )),
                Err(e) => errors.push(e.to_string()),
            }
        }
        errors
    });
    join_all(clients).await.into_iter().flatten().collect()
}

/// One of the two statements, by client and round: `(text, number)` that should come back
/// as `("c<client>", round)`.
async fn round_trip(
    db: &mut sqlx::PgConnection,
    named: bool,
    c: i64,
    round: i64,
) -> Result<(String, i64), sqlx::Error> {
    if (c + round) % 2 == 0 {
        let r = sqlx::query("SELECT $1::text, $2::int8")
            .persistent(named)
            .bind(format!("c{c}"))
            .bind(round)
            .fetch_one(&mut *db)
            .await?;
        Ok((r.try_get(0)?, r.try_get(1)?))
    } else {
        let r = sqlx::query("SELECT ('c' || $2::int8)::text, $1::int8")
            .persistent(named)
            .bind(round)
            .bind(c)
            .fetch_one(&mut *db)
            .await?;
        Ok((r.try_get(0)?, r.try_get(1)?))
    }
}
